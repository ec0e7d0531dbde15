"""Atomic, resumable checkpoints with torch.distributed.checkpoint (DCP).

Layout under the checkpoint directory:
    step-00000040/          published: complete, with manifest.json (step, sha256 per file)
    .tmp-step-00000050/     being written; never loaded, removed at the next start
    run-state.json          restart accounting (trainer.runstate)
    run-state.progress      the furthest step, rewritten in place every step
    owner.json              rank 0's claim on the directory: one job at a time (trainer.dirclaim)
    owner.displaced.json    whom the last takeover of that claim displaced

Every rank writes its shards into the temporary directory, then checksums the files
it wrote itself (while they are hot in its page cache) into
`checksums-rank<R>.json`, fsynced. Rank 0 builds the manifest from DCP's own
metadata (`.metadata`: the list of every storage file, not a directory listing,
which NFS may cache), waits until every file DCP lists has a checksum from its
writer, writes the manifest, fsyncs, renames the directory to its final name
(atomic on POSIX) and prunes to the newest K. Nobody re-reads the whole checkpoint
at save time. A crash at any instant leaves at most a temporary directory behind and
the previous checkpoint intact.

Resume verifies in parallel: rank r hashes every world-th file, the ranks agree, and
a checkpoint any rank finds corrupt or incomplete is skipped (logged, newest first).
One that verifies but does not load (`dcp.load` raises on some rank) is skipped too
(trainer.main), so a bad checkpoint is a fallback, not a crash loop.

Async saves (`async_save`) stage the state to host memory (the only part that blocks
training), then write in DCP's background thread, on a separate gloo group so that
checkpoint collectives never interleave with training collectives.

Every failed save, sync or async, is logged once with its exception type, message and
traceback, and counted (`CheckpointManager.failures`, sent to the agent as
`checkpoint_failures_total`): the CheckpointsFailing alert pages on consecutive ones.
"""

from __future__ import annotations

import contextlib
import errno
import functools
import hashlib
import json
import logging
import os
import shutil
import signal
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from clusterpulse.trainer.torch_support import save_planner, stager_api

log = logging.getLogger("clusterpulse.trainer.checkpoint")
MANIFEST = "manifest.json"


class CheckpointError(Exception):
    """A checkpoint could not be written (storage failure, injected fault)."""


@dataclass(frozen=True)
class Found:
    step: int
    path: Path


def step_dir(root: Path, step: int) -> Path:
    return root / f"step-{step:08d}"


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def rank_sums_name(rank: int) -> str:
    return f"checksums-rank{rank}.json"


def failed_sums_name(rank: int) -> str:
    return f"checksums-rank{rank}.failed"


def dcp_files(path: Path) -> list[str]:
    """The storage files DCP's metadata lists for the checkpoint at `path`."""
    from torch.distributed.checkpoint.filesystem import FileSystemReader

    md = FileSystemReader(str(path)).read_metadata()
    return sorted({si.relative_path for si in md.storage_data.values()})


def verify(path: Path, rank: int = 0, world: int = 1) -> str | None:
    """None if this rank's share of the checkpoint at `path` is intact, else what is
    wrong. Rank r hashes every world-th file of the manifest; the ranks agree."""
    manifest_path = path / MANIFEST
    try:
        manifest = json.loads(manifest_path.read_text())
        files = manifest["files"]
        if not isinstance(files, dict):
            raise TypeError
    except FileNotFoundError:
        return "no manifest (incomplete write)"
    except OSError as err:  # EIO, a stale NFS handle: unusable now, not a crash loop
        return f"manifest {UNREADABLE} ({err.strerror or err})"
    except (ValueError, KeyError, TypeError):
        return "manifest malformed"
    for i, (rel, digest) in enumerate(sorted(files.items())):
        if i % world != rank:
            continue
        f = path / rel
        try:
            if not f.is_file():
                return f"file {rel} missing"
            if _sha256(f) != digest:
                return f"file {rel} fails its checksum"
        except OSError as err:
            return f"file {rel} {UNREADABLE} ({err.strerror or err})"
    return None


def candidates(root: Path) -> list[Found]:
    """Published checkpoints, newest first."""
    out = []
    if root.is_dir():
        for p in root.iterdir():
            if p.is_dir() and p.name.startswith("step-"):
                try:
                    out.append(Found(int(p.name[5:]), p))
                except ValueError:
                    continue
    return sorted(out, key=lambda f: f.step, reverse=True)


UNREADABLE = "unreadable"  # a read error (EIO, ESTALE) may pass: the checkpoint stays


def iter_valid(root: Path, rank: int = 0, world: int = 1,
               agree: Callable[[bool], bool] = lambda ok: ok,
               unusable: Callable[[Found], None] = lambda found: None) -> Iterator[Found]:
    """Checkpoints that every rank verified, newest first (collective when `agree`
    is; every rank must iterate the same way). Logs each one skipped and why, and
    hands one that is certainly broken (not merely unreadable now on some rank: a
    transient storage error) to `unusable`, on every rank, once every rank looked."""
    for found in candidates(root):
        problem = verify(found.path, rank, world)
        if problem is not None:
            log.warning("checkpoint %s is unusable (%s); falling back to an older one",
                        found.path.name, problem)
            print(f"trainer: checkpoint {found.path.name} is unusable ({problem}); "
                  "falling back to an older one", flush=True)
        if agree(problem is None):
            yield found
        elif agree(problem is None or UNREADABLE not in problem):
            unusable(found)  # certainly broken on every rank that looked, not a read error


def model_mismatch(path: Path, model_shapes: dict[str, tuple[int, ...]]) -> str | None:
    """How the model parameters the checkpoint at `path` holds differ from
    `model_shapes` (name -> full shape, as `get_model_state_dict` names them), or None.
    A run resumed with other model settings (another `--preset`) than the run that
    wrote the directory: every checkpoint then verified, failed to load, and was set
    aside as unusable, and the corrected run started from step 0. That is the settings'
    fault, not the checkpoints'. None where the metadata cannot be read (verification
    and the load judge that)."""
    from torch.distributed.checkpoint.filesystem import FileSystemReader

    try:
        stored = FileSystemReader(str(path)).read_metadata().state_dict_metadata
    except Exception:  # any reader failure is the load's to report
        return None
    prefix = "app.model."
    theirs = {k[len(prefix):]: tuple(v.size) for k, v in stored.items()
              if k.startswith(prefix) and hasattr(v, "size")}
    if not theirs:  # not this trainer's layout: nothing to compare
        return None
    differ = [k for k in sorted(model_shapes) if k in theirs and theirs[k] != model_shapes[k]]
    missing = sorted(set(model_shapes) - set(theirs))
    extra = sorted(set(theirs) - set(model_shapes))
    if not (differ or missing or extra):
        return None
    parts = []
    if differ:
        k = differ[0]
        parts.append(f"{len(differ)} parameter(s) of another shape ({k}: {list(theirs[k])} "
                     f"there, {list(model_shapes[k])} here)")
    if missing:
        parts.append(f"{len(missing)} of this model's parameters not there ({missing[0]}, ...)")
    if extra:
        parts.append(f"{len(extra)} there that this model has not ({extra[0]}, ...)")
    return "; ".join(parts)


class AcrossTorchPlanner(dcp.DefaultLoadPlanner):
    """Loads every tensor this run's state asks for, and leaves the settings a torch of
    another version keeps and the writer's did not (a scheduler's `verbose` in 2.6,
    AdamW's `decoupled_weight_decay` in later releases: values, not tensors) at this
    run's values. A torch upgrade or downgrade of the job's image found every
    checkpoint "verifies but does not load" ("Missing key in checkpoint state_dict:
    app.sched.verbose"), set each aside, and started from step 0. A missing tensor
    still fails the load: that is another model or optimizer (`model_mismatch` names
    the model's), not another torch. `skipped` lists what was left."""

    def __init__(self) -> None:
        super().__init__(allow_partial_load=True)
        self.skipped: list[str] = []

    def create_local_plan(self) -> Any:
        stored = self.metadata.state_dict_metadata if self.metadata is not None else {}
        absent = [k for k in self.state_dict if k not in stored]
        tensors = [k for k in absent if isinstance(self.state_dict[k], torch.Tensor)]
        if tensors:
            raise RuntimeError(f"Missing key in checkpoint state_dict: {tensors[0]}.")
        self.skipped = sorted(absent)
        return super().create_local_plan()


def describe_error(err: BaseException) -> str:
    """One line for a failed DCP save or load: DCP's CheckpointException says only
    which ranks failed ("ranks:dict_keys([0])"); the first rank's own exception says
    why (a shape mismatch, "No space left on device")."""
    failures = getattr(err, "failures", None)
    if isinstance(failures, dict) and failures:
        first = next(iter(failures.values()))
        inner = first[0] if isinstance(first, tuple) else first
        if isinstance(inner, BaseException):
            err = inner
    text = str(err).strip().splitlines()
    return f"{type(err).__name__}: {text[0] if text else ''}"[:500]


def set_aside(found: Found) -> Path | None:
    """Move an unusable checkpoint out of the `step-*` names (one process does it, once
    every rank is done with it): kept as evidence, it no longer holds one of the
    `--keep` slots (retention goes by name: a stale newer checkpoint made every fresh
    one be deleted as soon as it was published) nor is it tried again at the next
    restart. None when it could not be moved (then it is only skipped, as before)."""
    target = found.path.with_name(f"unusable-{found.path.name}")
    if target.exists():
        target = target.with_name(f"{target.name}-{int(time.time())}")
    try:
        os.rename(found.path, target)
    except OSError as err:
        log.warning("cannot set %s aside: %s", found.path.name, err)
        return None
    return target


@functools.cache
def stager_survives_reuse() -> bool:
    """Whether one torch `DefaultStager` can stage more than one checkpoint.

    torch 2.11's `DefaultStager` closes its `StateDictStager` at the end of every stage
    (pytorch#170431, against a reference cycle), which empties the stager's copy dispatch
    table. The next stage then deep-copies the state dict by its pickling rules, reaches
    the class `dict` itself in `dict.__reduce_ex__`'s arguments and fails with
    `KeyError: <class 'type'>`: every async save after the first failed (fixed in
    pytorch#183424). Probed on a one-element dict rather than read from the version
    number, since that behaviour is what the manager depends on.
    """
    api = stager_api()
    if api is None:
        return False
    DefaultStager, StagingOptions = api
    stager = DefaultStager(StagingOptions(use_pinned_memory=False, use_shared_memory=False,
                                          use_async_staging=False, use_non_blocking_copy=False))
    try:
        for _ in range(2):
            stager.stage({"probe": torch.zeros(1)})
    except KeyError:
        return False
    finally:
        stager.close()
    return True


def commit_time(path: Path) -> float | None:
    """Unix time the checkpoint at `path` was committed: its manifest's `created_unix`,
    written just before the publishing rename (the manifest's own mtime where that
    field is missing), or None if the manifest cannot be read."""
    manifest = path / MANIFEST
    try:
        created = json.loads(manifest.read_text()).get("created_unix")
        if isinstance(created, (int, float)) and created > 0:
            return float(created)
        return manifest.stat().st_mtime
    except (OSError, ValueError, AttributeError):
        return None


def find_latest_valid(root: Path) -> Found | None:
    """The newest checkpoint that verifies (one process checks every file)."""
    return next(iter_valid(root), None)


class CheckpointManager:
    def __init__(self, root: Path, rank: int, keep: int = 3, async_save: bool = False,
                 group: dist.ProcessGroup | None = None,
                 before_publish: Callable[[int], None] | None = None,
                 after_publish: Callable[[int, Path], None] | None = None) -> None:
        self.root = root
        self.rank = rank
        self.keep = max(1, keep)
        self.async_save = async_save
        self.group = group
        self.before_publish = before_publish or (lambda step: None)
        self.after_publish = after_publish or (lambda step, path: None)
        self.committed_step: int | None = None
        self.committed_unix: float | None = None
        self.blocking_seconds_total = 0.0
        self.last_blocking_seconds = 0.0
        self.failures = 0
        self.publish_timeout_s = 300.0
        self._pending: tuple[int, threading.Event] | None = None
        # The save plan and the staging buffers are the same every time: cache them, so an
        # async save blocks training only for the copy into host memory. Where torch's
        # stager cannot be reused (stager_survives_reuse), each save gets a fresh one:
        # that torch drops its buffers after every stage anyway.
        self._planner = save_planner()
        self._stager: Any = None  # torch's DefaultStager, where it has one
        self._stager_api = stager_api() if async_save else None
        cuda = torch.cuda.is_available()
        self._stager_options = self._stager_api and self._stager_api[1](
            use_pinned_memory=cuda, use_shared_memory=False, use_async_staging=False,
            use_non_blocking_copy=cuda)
        if self._stager_api is not None:
            if stager_survives_reuse():
                self._stager = self._stager_api[0](self._stager_options)
            else:
                log.info("torch %s's DefaultStager closes itself after one stage "
                         "(pytorch#183413): a fresh stager per async checkpoint",
                         torch.__version__)
        self._lock = threading.Lock()
        root.mkdir(parents=True, exist_ok=True)
        # Writable, now: a read-only directory (a mount, a snapshot) let the run resume
        # and then die on its first write with a traceback, in a crash loop. Only a
        # refusal that lasts stops the start: a full disk (blocks or inodes) or a
        # passing NFS error fails the saves, counted and paged, and training goes on.
        probe = root / f".write-probe-{rank}-{os.getpid()}"
        try:
            probe.touch()
            probe.unlink(missing_ok=True)  # rank 0's clean_temporaries may be first
        except OSError as err:
            if err.errno not in (errno.EROFS, errno.EACCES, errno.EPERM, errno.ENOENT):
                log.warning("--ckpt-dir %s: a test write failed (%s); saves may fail",
                            root, err.strerror or err)
            else:
                raise OSError(err.errno, f"--ckpt-dir is not writable ({err.strerror})",
                              str(root)) from err

    def clean_temporaries(self) -> None:
        """Remove directories left by writes that never finished (rank 0, at start)."""
        for p in self.root.glob(".tmp-step-*"):
            shutil.rmtree(p, ignore_errors=True)
        for p in self.root.glob(".write-probe-*"):  # a process killed between its two calls
            with contextlib.suppress(OSError):
                p.unlink()

    def save(self, step: int, state: dict[str, Any], fail: bool = False,
             kill_midway: bool = False) -> float:
        """Write a checkpoint of `state` for `step`; returns the seconds training blocked.

        A failed write is logged and counted (and the temporary directory removed); the
        previous checkpoint stays the committed one and training goes on.
        """
        t0 = time.perf_counter()
        self.wait()  # one save in flight at a time
        tmp = self.root / f".tmp-step-{step:08d}"
        try:
            if fail:
                raise CheckpointError("injected checkpoint write failure")
            if self.async_save:
                stager = self._stager or self._new_stager()
                own = None if stager is self._stager else stager  # this save's: close after
                staging = {} if stager is None else {"async_stager": stager}
                try:
                    result = dcp.async_save(state, checkpoint_id=str(tmp),
                                            process_group=self.group, planner=self._planner,
                                            **staging)
                except BaseException:
                    if own is not None:
                        own.close()
                    raise
                fut = getattr(result, "upload_completion", result)
                if kill_midway:  # the process dies while the background write runs
                    os.kill(os.getpid(), signal.SIGKILL)
                done = threading.Event()
                self._pending = (step, done)
                fut.add_done_callback(
                    lambda f, s=step, p=tmp: self._finish_off_the_loop(f, s, p, done, own))
            else:
                dcp.save(state, checkpoint_id=str(tmp), process_group=self.group)
                if kill_midway:  # the data is written but not yet published
                    os.kill(os.getpid(), signal.SIGKILL)
                self._write_own_sums(tmp)
                if self.rank == 0:
                    self._publish(step, tmp)
                else:
                    self._set_committed(step)
        except (Exception, CheckpointException) as err:  # storage errors: training goes on
            self._failed(f"checkpoint at step {step}", err)
            if self.rank == 0:
                shutil.rmtree(tmp, ignore_errors=True)
            blocked = time.perf_counter() - t0
            self.last_blocking_seconds = blocked
            self.blocking_seconds_total += blocked
            raise CheckpointError(str(err)) from err
        blocked = time.perf_counter() - t0
        self.last_blocking_seconds = blocked
        self.blocking_seconds_total += blocked
        return blocked

    def _new_stager(self) -> Any:
        """A stager for one save, or None where torch has no DefaultStager (then
        dcp.async_save stages the state itself)."""
        return None if self._stager_api is None else self._stager_api[0](self._stager_options)

    def refuse(self, step: int, why: str) -> CheckpointError:
        """Count a save that is not made, nothing written or removed (the directory is
        another job's: trainer.dirclaim), as a failure: CheckpointsFailing pages."""
        self.failures += 1
        log.error("checkpoint at step %d not written: %s", step, why)
        return CheckpointError(why)

    def _failed(self, what: str, err: BaseException) -> None:
        """Count a failed save and log it once, whole: its type, message and traceback.
        (The message alone was `<class 'type'>` for torch 2.11's stager KeyError.)"""
        self.failures += 1
        log.error("%s failed: %s%s", what, describe_error(err), self.space_hint(),
                  exc_info=(type(err), err, err.__traceback__))

    def space_hint(self) -> str:
        """What a full file system looks like when torch's writer does not say so: a
        write that ran out of space came back as "[enforce fail at inline_container.cc]
        unexpected pos 704 vs 598". Said where the free space is below the newest
        checkpoint's size (at least 64 MiB)."""
        try:
            free = shutil.disk_usage(self.root).free
            newest = max(candidates(self.root), key=lambda f: f.step, default=None)
            size = sum(f.stat().st_size for f in newest.path.iterdir()) if newest else 0
        except OSError:
            return ""
        if free >= max(size, 64 << 20):
            return ""
        return (f" ({self.root} has {free / 2**20:.1f} MiB free, the newest checkpoint "
                f"takes {size / 2**20:.1f} MiB: the file system is full?)")

    def _finish_off_the_loop(self, fut: Future, step: int, tmp: Path, done: threading.Event,
                             stager: Any = None) -> None:
        """`_finish_async` on a thread of its own. A future already done when save()
        attaches its callback runs the callback at once, in save()'s thread: a write
        that finished first (a small state, a fast disk; seen on a clean machine) had its
        publish (sums, rename, pruning old checkpoints) run inside save(), in the
        training loop. Not a daemon: an exit waits for a publish under way."""
        try:
            threading.Thread(target=self._finish_async, args=(fut, step, tmp, done, stager),
                             name=f"checkpoint-publish-{step}").start()
        except RuntimeError:  # no thread to be had (a pids limit, interpreter shutdown):
            # here, as before; never a save left in flight for the next one to wait on
            self._finish_async(fut, step, tmp, done, stager)

    def _finish_async(self, fut: Future, step: int, tmp: Path, done: threading.Event,
                      stager: Any = None) -> None:
        """Runs once this rank's write is over (`_finish_off_the_loop`); closes `stager`,
        the save's own, once the write no longer needs its buffers."""
        try:
            fut.result()
            self._write_own_sums(tmp)
            if self.rank == 0:
                self._publish(step, tmp)
            else:
                self._set_committed(step)
        except (Exception, CheckpointException) as err:  # DCP's is a BaseException
            self._failed(f"async checkpoint at step {step}", err)
            if self.rank == 0:
                shutil.rmtree(tmp, ignore_errors=True)
        finally:
            if stager is not None:
                stager.close()
            done.set()

    def _set_committed(self, step: int) -> None:
        with self._lock:
            self.committed_step, self.committed_unix = step, time.time()

    def resumed_from(self, step: int, path: Path) -> None:
        """The run resumed from `step`'s checkpoint at `path`: that is the last committed
        checkpoint, committed when its manifest says; not now (CheckpointsFailing reads a
        change of this time as a commit: a resume that set it hid a run whose saves kept
        failing across its restarts, a review), nor time 0 (a resumed run sent 0:
        CheckpointStale paged at every restart). CheckpointStale counts from the later
        of this and the run's resume (`resume_timestamp_seconds`)."""
        with self._lock:
            self.committed_step, self.committed_unix = step, commit_time(path)

    def _write_own_sums(self, tmp: Path) -> None:
        """Checksum the files this rank wrote (DCP names them __<rank>_<n>.distcp). If
        that fails, an empty marker tells rank 0 at once (it needs no data block: it
        fits on a full disk): rank 0 waited the whole publish timeout, 300 s, with
        every rank stalled behind it, at every save while the disk stayed full."""
        try:
            self._write_sums_file(tmp)
        except OSError:
            with contextlib.suppress(OSError):
                os.close(os.open(tmp / failed_sums_name(self.rank),
                                 os.O_CREAT | os.O_WRONLY, 0o644))
            raise

    def _write_sums_file(self, tmp: Path) -> None:
        sums = {}
        for f in sorted(tmp.glob(f"__{self.rank}_*")):
            if f.is_file():
                sums[f.name] = _sha256(f)
                with open(f, "rb+") as fh:
                    os.fsync(fh.fileno())
        out = tmp / rank_sums_name(self.rank)
        with open(out.with_suffix(".tmp"), "w") as fh:
            json.dump({"rank": self.rank, "files": sums}, fh)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(out.with_suffix(".tmp"), out)

    def _gather_sums(self, tmp: Path, files: list[str]) -> dict[str, str]:
        """Every file's checksum from its writer; waits for writers still hashing."""
        deadline = time.monotonic() + self.publish_timeout_s
        sums: dict[str, str] = {}
        while True:
            failed = sorted(f.name for f in tmp.glob("checksums-rank*.failed"))
            if failed:
                raise CheckpointError(f"a rank could not write its checksums ({failed[0]}: "
                                      "see that rank's log)")
            for f in tmp.glob("checksums-rank*.json"):
                with contextlib.suppress(OSError, ValueError):
                    sums.update(json.loads(f.read_text())["files"])
            missing = [f for f in files if f not in sums]
            if not missing:
                return {f: sums[f] for f in files}
            if time.monotonic() > deadline:
                raise CheckpointError(f"no checksum from the writer of {missing[0]} "
                                      f"({len(missing)} files) after "
                                      f"{self.publish_timeout_s:.0f} s")
            time.sleep(0.05)

    def _publish(self, step: int, tmp: Path) -> None:
        self.before_publish(step)
        files = self._gather_sums(tmp, dcp_files(tmp))  # the list comes from DCP
        files[".metadata"] = _sha256(tmp / ".metadata")
        with open(tmp / ".metadata", "rb+") as fh:
            os.fsync(fh.fileno())
        manifest = {"step": step, "created_unix": time.time(), "files": files,
                    "files_from": "dcp-metadata",
                    "world_size": dist.get_world_size() if dist.is_initialized() else 1}
        with open(tmp / MANIFEST, "w") as fh:
            json.dump(manifest, fh, indent=1)
            fh.flush()
            os.fsync(fh.fileno())
        _fsync_dir(tmp)
        final = step_dir(self.root, step)
        if final.exists():  # a re-run of the same step after a restart: replace it
            shutil.rmtree(final)
        os.rename(tmp, final)
        _fsync_dir(self.root)
        self._set_committed(step)
        self._prune()
        log.info("checkpoint step %d committed at %s", step, final)
        self.after_publish(step, final)

    def _prune(self) -> None:
        """Keep the `keep` newest checkpoints up to the one just committed. One of a
        later step is not this run's (the resume skipped it: unreadable, or from a
        timeline the job went back from) and holds no slot: counted by name, a newer
        unreadable checkpoint made every fresh one be deleted as it was published, and
        the next crash restarted from step 0."""
        newest = self.committed_step if self.committed_step is not None else -1
        published = sorted(f.path for f in candidates(self.root) if f.step <= newest)
        for old in published[: -self.keep]:
            shutil.rmtree(old, ignore_errors=True)

    def wait(self) -> None:
        """Block until an in-flight async save has finished (and been published)."""
        if self._pending is not None:
            self._pending[1].wait()
            self._pending = None

    @property
    def in_flight(self) -> bool:
        return self._pending is not None and not self._pending[1].is_set()
