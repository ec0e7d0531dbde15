"""Kubernetes' Pod Security Standards, "baseline" and "restricted", checked on a pod spec.

Written from the standard's table of controls (kubernetes.io/docs/concepts/security/
pod-security-standards, policy version "latest" as of Kubernetes 1.34, with its host
probes and lifecycle hooks control) and the field paths its admission plugin reads; no
API server runs here to ask. Each violation is
one line naming the control and the field, as admission's own message does.
"""

from __future__ import annotations

BASELINE_CAPABILITIES = {"AUDIT_WRITE", "CHOWN", "DAC_OVERRIDE", "FOWNER", "FSETID", "KILL",
                         "MKNOD", "NET_BIND_SERVICE", "SETFCAP", "SETGID", "SETPCAP",
                         "SETUID", "SYS_CHROOT"}
SELINUX_TYPES = {"", "container_t", "container_init_t", "container_kvm_t",
                 "container_engine_t"}
SAFE_SYSCTLS = {"kernel.shm_rmid_forced", "net.ipv4.ip_local_port_range",
                "net.ipv4.ip_unprivileged_port_start", "net.ipv4.tcp_syncookies",
                "net.ipv4.ping_group_range", "net.ipv4.ip_local_reserved_ports",
                "net.ipv4.tcp_keepalive_time", "net.ipv4.tcp_fin_timeout",
                "net.ipv4.tcp_keepalive_intvl", "net.ipv4.tcp_keepalive_probes"}
RESTRICTED_VOLUMES = {"configMap", "csi", "downwardAPI", "emptyDir", "ephemeral",
                      "persistentVolumeClaim", "projected", "secret"}


def _containers(pod: dict) -> list[dict]:
    return [c for key in ("containers", "initContainers", "ephemeralContainers")
            for c in pod.get(key, [])]


APPARMOR_ANNOTATION = "container.apparmor.security.beta.kubernetes.io/"


def baseline(pod: dict, annotations: dict[str, str] | None = None) -> list[str]:
    """Violations of baseline by a pod's spec (and its metadata's annotations)."""
    out: list[str] = []
    for key, value in (annotations or {}).items():
        if key.startswith(APPARMOR_ANNOTATION) and value != "runtime/default" \
                and not value.startswith("localhost/"):
            out.append(f"appArmorProfile: annotation {key}={value}")
    psc = pod.get("securityContext", {})
    for ns in ("hostNetwork", "hostPID", "hostIPC"):
        if pod.get(ns):
            out.append(f"host namespaces: {ns}=true")
    for v in pod.get("volumes", []):
        if "hostPath" in v:
            out.append(f"hostPath volumes: volume {v['name']!r}")
    for sysctl in psc.get("sysctls", []):
        if sysctl["name"] not in SAFE_SYSCTLS:
            out.append(f"sysctls: {sysctl['name']}")
    contexts = [("pod", psc)] + [(f"container {c['name']!r}", c.get("securityContext", {}))
                                 for c in _containers(pod)]
    for where, sc in contexts:
        if sc.get("windowsOptions", {}).get("hostProcess"):
            out.append(f"hostProcess: {where}")
        se = sc.get("seLinuxOptions", {})
        if se.get("type", "") not in SELINUX_TYPES or se.get("user") or se.get("role"):
            out.append(f"seLinuxOptions: {where}")
        if sc.get("seccompProfile", {}).get("type") == "Unconfined":
            out.append(f"seccompProfile: {where} is Unconfined")
        if sc.get("appArmorProfile", {}).get("type") == "Unconfined":
            out.append(f"appArmorProfile: {where} is Unconfined")
    for c in _containers(pod):
        sc, name = c.get("securityContext", {}), c["name"]
        if sc.get("privileged"):
            out.append(f"privileged: container {name!r}")
        extra = set(sc.get("capabilities", {}).get("add", [])) - BASELINE_CAPABILITIES
        if extra:
            out.append(f"capabilities: container {name!r} adds {sorted(extra)}")
        if sc.get("procMount", "Default") != "Default":
            out.append(f"procMount: container {name!r}")
        for port in c.get("ports", []):
            if port.get("hostPort"):
                out.append(f"hostPorts: container {name!r} port {port['hostPort']}")
        handlers = [(k, c[k]) for k in ("livenessProbe", "readinessProbe", "startupProbe")
                    if k in c] + [(f"lifecycle.{k}", h)
                                  for k, h in c.get("lifecycle", {}).items()]
        for where, handler in handlers:
            for kind in ("httpGet", "tcpSocket"):
                if handler.get(kind, {}).get("host"):
                    out.append(f"host probes / lifecycle hooks: container {name!r} {where}")
    return out


def restricted(pod: dict, annotations: dict[str, str] | None = None) -> list[str]:
    """Violations of restricted (baseline's included)."""
    out = baseline(pod, annotations)
    psc = pod.get("securityContext", {})
    for v in pod.get("volumes", []):
        kinds = set(v) - {"name"}
        if not kinds <= RESTRICTED_VOLUMES:
            out.append(f"volume types: volume {v['name']!r} is {sorted(kinds)}")
    for c in _containers(pod):
        sc, name = c.get("securityContext", {}), c["name"]
        if sc.get("allowPrivilegeEscalation") is not False:
            out.append(f"allowPrivilegeEscalation != false: container {name!r}")
        if not sc.get("runAsNonRoot", psc.get("runAsNonRoot")):
            out.append(f"runAsNonRoot != true: container {name!r}")
        if sc.get("runAsUser", psc.get("runAsUser")) == 0:
            out.append(f"runAsUser=0: container {name!r}")
        seccomp = sc.get("seccompProfile", psc.get("seccompProfile", {})).get("type")
        if seccomp not in ("RuntimeDefault", "Localhost"):
            out.append(f"seccompProfile: container {name!r} must be RuntimeDefault or Localhost")
        caps = sc.get("capabilities", {})
        if "ALL" not in caps.get("drop", []):
            out.append(f"unrestricted capabilities: container {name!r} must drop ALL")
        if set(caps.get("add", [])) - {"NET_BIND_SERVICE"}:
            out.append(f"unrestricted capabilities: container {name!r} adds "
                       f"{sorted(set(caps['add']) - {'NET_BIND_SERVICE'})}")
    if psc.get("runAsUser") == 0:
        out.append("runAsUser=0: pod")
    return out
