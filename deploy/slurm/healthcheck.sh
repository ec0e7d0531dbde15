#!/bin/sh
# Slurm HealthCheckProgram for ClusterPulse nodes. It ships in the package: on each
# node `clusterpulse-config write /etc/clusterpulse --only slurm` writes it, executable,
# to /etc/clusterpulse/slurm/healthcheck.sh. In slurm.conf:
#   HealthCheckProgram=/etc/clusterpulse/slurm/healthcheck.sh
#   HealthCheckInterval=60
#   HealthCheckNodeState=ANY
# slurmd runs it with an (almost) empty environment: only SLURMD_NODENAME is set, and
# it takes no arguments. Settings therefore come from an env file:
#   /etc/default/clusterpulse-healthcheck (or $CLUSTERPULSE_HEALTHCHECK_ENV), e.g.
#     CLUSTERPULSE_HEALTHCHECK=/opt/clusterpulse/.venv/bin/clusterpulse-healthcheck
#     CLUSTERPULSE_AGENT_URL=http://127.0.0.1:9477
#     SLURM_CONF=/etc/slurm/slurm.conf
# Like LBNL NHC it drains the node itself with a reason (`scontrol update ...
# State=DRAIN Reason="clusterpulse: GPU 3 down (gpu_is_lost)"`) and resumes it once
# healthy, but only if its own reason is the one set. It reads a running agent (the
# systemd unit in deploy/systemd/); an agent that does not answer (not started yet,
# restarting, or run only as a job step, so absent on idle nodes) is "unknown" (exit
# 2), and on unknown the node is neither drained nor resumed: a monitoring hiccup
# never takes a node out of service.
PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin
export PATH
envfile=${CLUSTERPULSE_HEALTHCHECK_ENV:-/etc/default/clusterpulse-healthcheck}
if [ -r "$envfile" ]; then
  set -a
  . "$envfile"
  set +a
fi
exec "${CLUSTERPULSE_HEALTHCHECK:-/opt/clusterpulse/.venv/bin/clusterpulse-healthcheck}" \
  --drain --detach "$@"
