"""Gradient accumulation through the framework callbacks, with real tiny Trainers in
this process. Lightning: a Pulse step is one optimizer step, all its micro-batches,
and a graceful restart is taken only where an optimizer step ended. Taken after the
first micro-batch of a step, the checkpoint held no accumulated gradient while the
loader's position skipped that micro-batch: the resumed step applied the second one
alone, and the first one's samples never reached the weights.

The restart is asked for as the agent asks: a `checkpoint-restart` command in a reply
on the rank's connection, here from a listener standing in for the agent, sent while
the step's first micro-batch trains (so it is read at that batch's end).

The Hugging Face Trainer's step events bracket a whole optimizer step already; its
samples were counted as the batch size times the accumulation, also for the epoch's
last step, which has fewer micro-batches when they do not divide the epoch."""

from __future__ import annotations

import json
import socket
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
import torch.distributed as dist
from torch.utils.data import Dataset
from transformers import Trainer, TrainingArguments

from clusterpulse.integrations import hf
from clusterpulse.integrations.data import ResumableDataLoader
from clusterpulse.integrations.lightning import ClusterPulseCallback
from clusterpulse.trainer import RESTART_EXIT_CODE
from clusterpulse.trainer.restart import RELAUNCH_FILE_ENV
from tests.conftest import socket_path

BATCHES, BATCH_SIZE, ACCUMULATE = 8, 2, 2  # one epoch: 4 optimizer steps


class TelemetrySink:
    """A SOCK_SEQPACKET listener standing in for the agent: keeps every message of
    every connection (one per Pulse, so one per attempt), in order, and replies only
    when told to (`command`). Read as it arrives: a connection's queue holds few
    messages unread."""

    def __init__(self, path: str) -> None:
        self.address = f"unix:{path}"
        self.server = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self.server.bind(path)
        self.server.listen(4)
        self.connections: list[list[dict[str, Any]]] = []
        self._conns: list[socket.socket] = []
        self._accepted = threading.Condition()
        self._readers: list[threading.Thread] = []
        self._acceptor = threading.Thread(target=self._accept, daemon=True)
        self._acceptor.start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.server.accept()
            except OSError:  # closed
                return
            messages: list[dict[str, Any]] = []
            reader = threading.Thread(target=self._read, args=(conn, messages), daemon=True)
            with self._accepted:
                self.connections.append(messages)
                self._conns.append(conn)
                self._readers.append(reader)
                self._accepted.notify_all()
            reader.start()

    @staticmethod
    def _read(conn: socket.socket, into: list[dict[str, Any]]) -> None:
        with conn:
            while data := conn.recv(65536):
                into.append(json.loads(data))

    def _connection(self, attempt: int) -> socket.socket:
        """The connection of `attempt` (0: the first Pulse's), once accepted."""
        with self._accepted:
            if not self._accepted.wait_for(lambda: len(self._conns) > attempt, timeout=60):
                raise RuntimeError(f"attempt {attempt} never connected")
            return self._conns[attempt]

    def command(self, attempt: int, action: str) -> None:
        """Send a command to the Pulse of `attempt`, as the agent's reply does; in its
        receive queue when this returns."""
        self._connection(attempt).send(json.dumps({"type": "agent", "commands": [
            {"id": f"cmd-{attempt}", "action": action}]}).encode())

    def step_messages(self, attempts: int) -> list[list[dict[str, Any]]]:
        """The step messages of each of the first `attempts` attempts. Each Pulse has
        closed its connection by now: its reader ends once it has read it all."""
        self._connection(attempts - 1)
        for reader in self._readers[:attempts]:
            reader.join()
        return [[m for m in c if m["type"] == "step"] for c in self.connections[:attempts]]

    def steps(self, attempts: int) -> list[list[tuple[int, int]]]:
        """(step, samples_total) of each step message, per attempt."""
        return [[(m["step"], m["samples_total"]) for m in c]
                for c in self.step_messages(attempts)]

    def close(self) -> None:
        self.server.shutdown(socket.SHUT_RDWR)  # wakes the acceptor
        self.server.close()
        self._acceptor.join()


@pytest.fixture
def sink() -> Iterator[TelemetrySink]:
    telemetry = TelemetrySink(socket_path("accumulate"))
    yield telemetry
    telemetry.close()
    if dist.is_initialized():  # the callback's init_distributed made a world of one
        dist.destroy_process_group()


class Samples(Dataset):
    def __init__(self) -> None:
        g = torch.Generator().manual_seed(0)
        n = BATCHES * BATCH_SIZE
        self.x, self.y = torch.rand(n, 4, generator=g), torch.rand(n, 1, generator=g)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor, int]:
        return self.x[i], self.y[i], i


class Tiny(pl.LightningModule):
    """Records the samples it trains on; `while_training(batch_idx)` runs in each
    training_step (the test's agent sends its command there)."""

    def __init__(self, while_training: Callable[[int], None] | None = None) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = torch.nn.Linear(4, 1)
        self.while_training = while_training
        self.trained: list[int] = []
        self.losses: list[torch.Tensor] = []

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y, idx = batch
        self.trained += idx.tolist()
        if self.while_training is not None:
            self.while_training(batch_idx)
        loss = torch.nn.functional.mse_loss(self.net(x), y)
        self.losses.append(loss.detach())
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)


def fit(checkpoint: Path, sink: TelemetrySink,
        while_training: Callable[[int], None] | None = None) -> Tiny:
    """One attempt of the job: from the graceful checkpoint if there is one."""
    model = Tiny(while_training)
    pulse = ClusterPulseCallback(run="accumulate", checkpoint=checkpoint, agent=sink.address,
                                 consensus_every=1)
    trainer = pl.Trainer(accelerator="cpu", devices=1, max_epochs=1,
                         accumulate_grad_batches=ACCUMULATE, callbacks=[pulse], logger=False,
                         enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False)
    trainer.fit(model, ResumableDataLoader(Samples(), batch_size=BATCH_SIZE),
                ckpt_path=pulse.resume_from())
    return model


def test_lightning_accumulation_restarts_only_between_optimizer_steps(tmp_path, sink,
                                                                     monkeypatch):
    monkeypatch.delenv(RELAUNCH_FILE_ENV, raising=False)  # a plain torchrun's exit code
    whole = fit(tmp_path / "whole.ckpt", sink)
    assert whole.trained == list(range(BATCHES * BATCH_SIZE))
    per_step = ACCUMULATE * BATCH_SIZE
    steps = BATCHES // ACCUMULATE
    # one step message per optimizer step, with all its micro-batches' samples and the
    # mean of their losses (Lightning hands each over divided by the accumulation)
    assert sink.steps(1) == [[(s, s * per_step) for s in range(1, steps + 1)]]
    means = [float(sum(loss / ACCUMULATE for loss in whole.losses[i:i + ACCUMULATE]))
             for i in range(0, BATCHES, ACCUMULATE)]
    assert [m["loss"] for m in sink.step_messages(1)[0]] == means

    def restart_in_step_2(batch_idx: int) -> None:  # its first micro-batch
        if batch_idx == ACCUMULATE:
            sink.command(1, "checkpoint-restart")

    with pytest.raises(SystemExit) as left:
        fit(tmp_path / "cut.ckpt", sink, restart_in_step_2)
    assert left.value.code == RESTART_EXIT_CODE
    resumed = fit(tmp_path / "cut.ckpt", sink)
    first, second = sink.steps(3)[1:]
    assert first == [(1, per_step), (2, 2 * per_step)]  # saved once step 2 was taken
    assert second == [(s, (s - 2) * per_step) for s in range(3, steps + 1)]
    assert resumed.trained == list(range(2 * per_step, BATCHES * BATCH_SIZE))
    for ours, theirs in zip(resumed.parameters(), whole.parameters(), strict=True):
        assert torch.equal(ours, theirs), (ours, theirs)  # no micro-batch lost


class Regression(torch.nn.Module):
    """A model as the HF Trainer takes one: keyword inputs, the loss in its output."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = torch.nn.Linear(4, 1)

    def forward(self, x: torch.Tensor, labels: torch.Tensor) -> dict[str, torch.Tensor]:
        return {"loss": torch.nn.functional.mse_loss(self.net(x), labels)}


def test_hf_accumulation_counts_the_samples_each_optimizer_step_trained(tmp_path, sink):
    data = Samples()
    examples = [{"x": data.x[i], "labels": data.y[i]} for i in range(len(data) - BATCH_SIZE)]
    args = TrainingArguments(output_dir=str(tmp_path / "out"), per_device_train_batch_size=
                             BATCH_SIZE, gradient_accumulation_steps=ACCUMULATE,
                             num_train_epochs=1, save_strategy="no", logging_strategy="no",
                             report_to="none", disable_tqdm=True, use_cpu=True)
    trainer = Trainer(model=Regression(), args=args, train_dataset=examples)
    hf.ClusterPulseCallback.attach(trainer, run="accumulate-hf", agent=sink.address)
    trainer.train()
    # 7 batches: 3 steps of 2 micro-batches, and the epoch's last step of 1
    per_step = ACCUMULATE * BATCH_SIZE
    assert sink.steps(1) == [[(1, per_step), (2, 2 * per_step), (3, 3 * per_step),
                             (4, len(examples))]]
