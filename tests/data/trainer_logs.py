"""Logs of the bundled trainer failing for real: plain, under torchrun with 2 ranks, and
as 2 nodes (two torchrun agents, --nnodes 2, on 127.0.0.1), all on CPU with gloo.

    python tests/data/make_real_logs.py --trainer            # every scenario below
    python tests/data/make_real_logs.py --trainer torchrun-sigkill-rank1

Each scenario writes tests/data/logs/<name>.log (one per node: <name>.node0.log, ...)
and a sidecar <name>.expected.json (<name>.node0.expected.json, ...):

    {"exit_code": 1, "root_cause": {"category": "killed", "rank": 1}, "consequences":
     [{"category": "peer_lost", "rank": 0}], "stopped": null}

`root_cause` null: no crash may be found (clean runs, clean stops); `stopped`: the clean
stop the log must be read as ({"step": N}). tests/test_crash_corpus.py scores them.
What a scenario does to the run (SIGSTOP a rank, SIGTERM the job, hold the port) it does
from outside, the way it happens to a user, when the log shows the moment has come.
"""

from __future__ import annotations

import json
import os
import re
import selectors
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
TRAINER = ROOT / "trainer"
LOG_DIR = Path(__file__).resolve().parent / "logs"
# A few seconds of training on a loaded 2-core machine; a step line every 5 steps.
QUICK = (
    "train.steps=60",
    "train.log_every=5",
    "data.num_samples=32",
    "eval.enabled=false",
    "runtime.threads=1",
)
LONG = ("train.steps=4000",)  # stopped from outside well before the end
STEP_LINE = re.compile(r"^(?:\[rank\d+\]: )?step (\d+)/")
RANK1_PID = re.compile(r"^\[rank1\]: distributed: rank 1/\d+ on host \S+ \(pid (\d+)\)")


@dataclass(frozen=True)
class TrainerScenario:
    name: str
    expected: list[dict]  # per node (one entry for a single log): see the module doc
    sets: tuple[str, ...] = ()
    ranks: int = 1  # 1: plain python; 2: torchrun --nproc-per-node 2 (per node with nodes > 1)
    nodes: int = 1  # 2: two torchrun agents, one rank each
    action: str | None = None  # what is done to the run from outside (see _Act)
    python: str | None = None  # another interpreter (the setup error)
    files: dict[str, str] = field(default_factory=dict)  # name -> text, in the scratch dir
    timeout_s: float = 300
    # Python run in the trainer's process before the trainer itself (a user's wrapper:
    # an added thread, a lock-order bug): written to {scratch}/entry.py, which then runs
    # train_dflash_pipeline.py as __main__ (tests/data/trainer_wrappers.py).
    wrapper: str | None = None
    env: dict[str, str] = field(default_factory=dict)
    binary_files: dict[str, bytes] = field(default_factory=dict)
    # (file under trainer/, text, replacement): run a copy of the trainer with this edit.
    patch: tuple[str, str, str] | None = None
    # Run node k's launcher in a network namespace of its own with a master address that
    # drops every packet (a dummy interface): a wrong master address, a connection
    # timing out.
    unreachable_nodes: tuple[int, ...] = ()
    launcher_args: tuple[str, ...] = ()
    stop_grace_s: float = 10  # after the stop's SIGTERM, SIGKILL (as dflashctl stop does)


def _peer_lost(rank: int = 0) -> dict:
    return {"category": "peer_lost", "rank": rank}


SCENARIOS = [
    # --- clean: no crash may be found -----------------------------------------------
    TrainerScenario("trainer-clean", [{"exit_code": 0, "root_cause": None}]),
    TrainerScenario("torchrun-clean", [{"exit_code": 0, "root_cause": None}], ranks=2),
    TrainerScenario(
        "nodes-clean",
        [{"exit_code": 0, "root_cause": None}, {"exit_code": 0, "root_cause": None}],
        nodes=2,
    ),
    # --- clean stops: SIGTERM / Ctrl-C, a checkpoint, the trainer's stop line -------
    TrainerScenario(
        "trainer-sigterm-stop",
        [{"exit_code": 0, "root_cause": None, "stopped": True}],
        sets=LONG,
        action="sigterm",
    ),
    TrainerScenario(
        "trainer-double-ctrl-c",
        [{"root_cause": None, "stopped": True}],
        sets=LONG,
        action="sigint-twice",
    ),
    TrainerScenario(
        "torchrun-sigterm-stop",
        [{"root_cause": None, "stopped": True}],
        sets=LONG,
        ranks=2,
        action="sigterm",
    ),
    TrainerScenario(
        "torchrun-double-ctrl-c",
        [{"root_cause": None, "stopped": True}],
        sets=LONG,
        ranks=2,
        action="sigint-twice-late",
    ),
    TrainerScenario(
        "torchrun-ctrl-c",
        [{"root_cause": None, "stopped": True}],
        sets=LONG,
        ranks=2,
        action="sigint",
    ),
    # --- ranks failing --------------------------------------------------------------
    TrainerScenario(
        "torchrun-sigkill-rank1",
        [
            {
                "exit_code": 1,
                "root_cause": {"category": "killed", "rank": 1, "local_rank": 1},
                "consequences": [_peer_lost(0)],
            }
        ],
        sets=(
            "debug.fail_in=drafter-0@step:10",
            "debug.fail_kind=sigkill",
            "debug.on_ranks=[1]",
        ),
        ranks=2,
    ),
    TrainerScenario(
        "torchrun-thread-exception-rank1",
        [
            {
                "exit_code": 1,
                "root_cause": {"category": "thread_exception", "rank": 1, "thread": "drafter-0"},
                "consequences": [{"category": "peer_failure", "rank": 0}],
            }
        ],
        sets=("debug.fail_in=drafter-0@step:10", "debug.on_ranks=[1]"),
        ranks=2,
    ),
    TrainerScenario(
        "torchrun-sigstop-rank1",
        # Rank 0 noticed; rank 1, stopped, is the one its PeerFailure names.
        [{"exit_code": 1, "root_cause": {"category": "peer_lost", "rank": 1}}],
        sets=LONG,
        ranks=2,
        action="sigstop-rank1",
    ),
    TrainerScenario(
        "torchrun-gloo-timeout",
        [{"exit_code": 1, "root_cause": {"category": "gloo_timeout", "rank": 1}}],
        # Rank 1 hangs in its step loop (its heartbeat goes on, so the trainer cannot
        # name it): rank 0's next all-reduce times out in gloo, waiting for rank 1.
        sets=(
            *LONG,
            "runtime.dist_timeout_s=10",
            "runtime.peer_timeout_s=5",
            "debug.hold_at_step=10",
            "debug.on_ranks=[1]",
        ),
        ranks=2,
    ),
    TrainerScenario(
        "nodes-sigkill-rank1",
        [
            # Node a's rank 0 noticed; its PeerFailure names rank 1, on the other node.
            {"exit_code": 1, "root_cause": {"category": "peer_lost", "rank": 1, "node": None}},
            {
                "exit_code": 1,
                "root_cause": {"category": "killed", "rank": 1, "node": "node-b"},
            },
        ],
        sets=(
            "debug.fail_in=drafter-0@step:10",
            "debug.fail_kind=sigkill",
            "debug.on_ranks=[1]",
        ),
        nodes=2,
    ),
    TrainerScenario(
        "nodes-sigstop-rank1",
        [
            # Node a's rank 0 noticed; its PeerFailure names rank 1, on the other node.
            {"exit_code": 1, "root_cause": {"category": "peer_lost", "rank": 1, "node": None}},
            # The stopped rank says nothing of its own and its agent waits on: the
            # generator ends it with SIGKILL after timeout_s, as a user would by hand.
            {"root_cause": {"category": "killed", "node": "node-b"}},
        ],
        sets=LONG,
        nodes=2,
        action="sigstop-rank1",
    ),
    # --- the environment ------------------------------------------------------------
    TrainerScenario(
        "trainer-data-error",
        [{"exit_code": 1, "root_cause": {"category": "data_error"}, "detail": "train.jsonl:3"}],
        sets=("data.source={scratch}/train.jsonl",),
        files={
            "train.jsonl": '{"text": "one good record"}\n{"text": "another"}\n'
            '{"text": "cut off here\n{"text": "never read"}\n'
        },
    ),
    TrainerScenario(
        "trainer-disk-full",
        [{"exit_code": 1, "root_cause": {"category": "disk_full"}}],
        sets=("output_dir={scratch}/full/outputs",),
        action="tiny-disk",
    ),
    TrainerScenario(
        "trainer-host-memory",
        [{"exit_code": 1, "root_cause": {"category": "host_memory"}}],
        sets=("data.source=random", "data.num_samples=2000000", "data.seq_len=2000000"),
    ),
    TrainerScenario(
        "torchrun-port-in-use",
        [{"exit_code": 1, "root_cause": {"category": "port_in_use"}}],
        ranks=2,
        action="hold-port",
    ),
    TrainerScenario(
        "trainer-setup-error",
        [{"exit_code": 1, "root_cause": {"category": "setup_error"}}],
        python="/usr/bin/python3",  # the system's Python: yaml, but no torch nor pydantic
    ),
    TrainerScenario(
        "trainer-vocab-mismatch",
        [{"exit_code": 2, "root_cause": {"category": "config_error"}}],
        sets=("data.tokenizer={scratch}/tokenizer",),
        action="big-tokenizer",
    ),
]


# A network namespace of the run's own in which packets to 10.9.0.2 are dropped (nft):
# a connection to it times out, as to a wrong master address.
UNREACHABLE = [
    "unshare",
    "--net",
    "sh",
    "-c",
    "ip link set lo up && ip addr add 10.9.0.1/24 dev lo && nft add table inet f && "
    'nft "add chain inet f out { type filter hook output priority 0; policy accept; }" && '
    'nft add rule inet f out ip daddr 10.9.0.2 drop && exec "$@"',
    "unreachable",
]


def wrapper_program(code: str, trainer: Path) -> str:
    """entry.py: `code` (with the trainer's modules importable), then the trainer."""
    return (
        "import runpy, sys\n"
        f"sys.path.insert(0, {str(trainer)!r})\n"
        f"{code}\n"
        f"sys.argv[0] = {str(trainer / 'train_dflash_pipeline.py')!r}\n"
        "runpy.run_path(sys.argv[0], run_name='__main__')\n"
    )


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _command(scenario: TrainerScenario, python: str, port: int, node: int) -> list[str]:
    script = "{scratch}/entry.py" if scenario.wrapper else "train_dflash_pipeline.py"
    entry = [script, "--config", "configs/tiny-cpu.yaml"]
    for item in (*QUICK, *scenario.sets):
        entry += ["--set", item]
    if scenario.ranks == 1 and scenario.nodes == 1:
        return [python, *entry]
    launcher = [python, "-m", "torch.distributed.run"]
    if scenario.nodes > 1:
        launcher += [
            f"--nnodes={scenario.nodes}",
            f"--node-rank={node}",
            f"--nproc-per-node={scenario.ranks}",
        ]
    else:
        launcher += [f"--nproc-per-node={scenario.ranks}"]
    addr = "10.9.0.2" if node in scenario.unreachable_nodes else "127.0.0.1"
    launcher += list(scenario.launcher_args)
    return [*launcher, f"--master-addr={addr}", f"--master-port={port}", *entry]


class _Act:
    """What a scenario does to the running job, decided line by line."""

    def __init__(self, scenario: TrainerScenario, procs: list[subprocess.Popen]) -> None:
        self.action = scenario.action
        self.procs = procs
        self.rank1_pid: int | None = None
        self.done = False
        self.second_sent = False
        self.grace_s = scenario.stop_grace_s
        self.kill_at: float | None = None  # the stop's SIGKILL, once its grace has run out
        self.started = time.monotonic()

    def _stop(self) -> None:
        """As `dflashctl stop` does: SIGTERM to each group, SIGKILL after the grace."""
        self.done = True
        for proc in self.procs:
            os.killpg(proc.pid, signal.SIGTERM)
        self.kill_at = time.monotonic() + self.grace_s

    def tick(self) -> None:
        """Called twice a second: what is done by the clock rather than by a line."""
        now = time.monotonic()
        # Ctrl-C a moment after the start: while Python still imports torch.
        if self.action == "sigint-at-start" and not self.done and now - self.started > 1.5:
            self.done = True
            for proc in self.procs:
                os.killpg(proc.pid, signal.SIGINT)
        if self.kill_at is not None and now >= self.kill_at:
            self.kill_at = None
            for proc in self.procs:
                if proc.poll() is None:
                    os.killpg(proc.pid, signal.SIGKILL)

    def line(self, text: str) -> None:
        found = RANK1_PID.match(text)
        if found:
            self.rank1_pid = int(found[1])
        step = STEP_LINE.match(text)
        at_step = step is not None and int(step[1]) >= 10
        stops = ("sigterm", "sigint", "sigint-twice", "sigint-twice-late")
        if self.action in stops and at_step and not self.done:
            self.done = True
            sig = signal.SIGTERM if self.action == "sigterm" else signal.SIGINT
            for proc in self.procs:  # as `dflashctl stop` (and a terminal's Ctrl-C) do: the group
                os.killpg(proc.pid, sig)
        # Ctrl-C twice: at once (the trainer abandons its step), or once the checkpoint
        # is written and the job is on its way out.
        second = self.action == "sigint-twice" and text.startswith("received SIGINT: ")
        late = self.action == "sigint-twice-late" and text.startswith("stopped by SIGINT after")
        if second or late:
            if not self.second_sent:
                self.second_sent = True
                for proc in self.procs:
                    os.killpg(proc.pid, signal.SIGINT)
        # The trainer's watchdog said it hangs: the user stops the run.
        if self.action == "stop-on-watchdog" and "watchdog: " in text and not self.done:
            self._stop()
        if self.action == "sigstop-rank1" and at_step and not self.done and self.rank1_pid:
            self.done = True
            os.kill(self.rank1_pid, signal.SIGSTOP)

    def cleanup(self) -> None:
        if self.action == "sigstop-rank1" and self.rank1_pid:
            for sig in (signal.SIGCONT, signal.SIGKILL):
                try:
                    os.kill(self.rank1_pid, sig)
                except ProcessLookupError:
                    pass


def run_scenario(scenario: TrainerScenario) -> list[tuple[str, int | None]]:
    """Run it; (log text, exit status) per node."""
    scratch = Path(tempfile.mkdtemp(prefix=f"dflash-{scenario.name}-"))
    mounted = None
    held = None
    try:
        for name, text in scenario.files.items():
            (scratch / name).write_text(text)
        for name, data in scenario.binary_files.items():
            (scratch / name).write_bytes(data)
        trainer = TRAINER
        if scenario.patch is not None:
            trainer = scratch / "trainer"
            shutil.copytree(TRAINER, trainer, ignore=shutil.ignore_patterns("__pycache__"))
            edited, old, new = scenario.patch
            text = (trainer / edited).read_text()
            assert old in text, f"{edited} no longer holds {old!r}"
            (trainer / edited).write_text(text.replace(old, new, 1))
        if scenario.wrapper:
            (scratch / "entry.py").write_text(wrapper_program(scenario.wrapper, trainer))
        if scenario.action == "tiny-disk":
            mounted = scratch / "full"
            mounted.mkdir()
            # Room for the run's start, not for its checkpoint: as a disk fills up.
            subprocess.run(
                ["mount", "-t", "tmpfs", "-o", "size=160k", "tmpfs", str(mounted)], check=True
            )
        if scenario.action == "big-tokenizer":
            _write_big_tokenizer(scratch / "tokenizer")
        port = free_port()
        if scenario.action == "hold-port":
            held = socket.socket()
            held.bind(("127.0.0.1", port))
            held.listen()
        python = scenario.python or sys.executable
        procs = []
        for node in range(scenario.nodes):
            (scratch / f"run{node}").mkdir()  # as the launch makes the run's folder
            env = {
                **os.environ,
                "DFLASH_RUN_DIR": str(scratch / f"run{node}"),
                "PYTHONUNBUFFERED": "1",
                "PET_LOG_DIR": str(scratch / f"run{node}" / "torchelastic"),
                "TORCHELASTIC_ERROR_FILE": str(scratch / f"run{node}" / "error.json"),
                **scenario.env,
            }
            if scenario.nodes > 1:  # as dflashctl launches each node
                env.update(DFLASH_NODE_NAME=f"node-{'ab'[node]}", DFLASH_NUM_NODES="2")
            command = _command(scenario, python, port, node)
            command = [part.replace("{scratch}", str(scratch)) for part in command]
            if node in scenario.unreachable_nodes:
                command = [*UNREACHABLE, *command]
            procs.append(
                subprocess.Popen(
                    command,
                    cwd=trainer,
                    env=env,
                    stdout=subprocess.PIPE,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,
                )
            )
        return _collect(scenario, procs)
    finally:
        if held is not None:
            held.close()
        if mounted is not None:
            subprocess.run(["umount", str(mounted)], check=False)
        shutil.rmtree(scratch, ignore_errors=True)


def _collect(
    scenario: TrainerScenario, procs: list[subprocess.Popen]
) -> list[tuple[str, int | None]]:
    act = _Act(scenario, procs)
    outputs = [bytearray() for _ in procs]
    partial = [b"" for _ in procs]
    selector = selectors.DefaultSelector()
    for index, proc in enumerate(procs):
        selector.register(proc.stdout, selectors.EVENT_READ, index)
    deadline = time.monotonic() + scenario.timeout_s
    open_streams = len(procs)
    try:
        while open_streams and time.monotonic() < deadline:
            act.tick()
            for key, _ in selector.select(timeout=0.5):
                index = key.data
                chunk = os.read(key.fileobj.fileno(), 65536)
                if not chunk:
                    selector.unregister(key.fileobj)
                    open_streams -= 1
                    continue
                outputs[index] += chunk
                lines = (partial[index] + chunk).split(b"\n")
                partial[index] = lines.pop()
                for line in lines:
                    act.line(line.decode("utf-8", "replace"))
    finally:
        act.cleanup()
        for proc in procs:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
    codes = [proc.wait() for proc in procs]
    return [
        (out.decode("utf-8", "replace"), code) for out, code in zip(outputs, codes, strict=True)
    ]


def _write_big_tokenizer(folder: Path) -> None:
    """The tiny tokenizer with more ids (600) than the tiny target's vocabulary (512)."""
    sys.path.insert(0, str(TRAINER))
    from dflash.data import build_tiny_tokenizer

    build_tiny_tokenizer(600).save_pretrained(str(folder))


def log_names(scenario: TrainerScenario) -> list[str]:
    if scenario.nodes == 1:
        return [scenario.name]
    return [f"{scenario.name}.node{node}" for node in range(scenario.nodes)]


def write_logs(scenario: TrainerScenario) -> list[Path]:
    written = []
    results = run_scenario(scenario)
    for name, (text, code), expected in zip(
        log_names(scenario), results, scenario.expected, strict=True
    ):
        log = LOG_DIR / f"{name}.log"
        log.write_text(text, encoding="utf-8")
        sidecar = {"exit_code": code, **{k: v for k, v in expected.items() if k != "exit_code"}}
        if "exit_code" in expected and expected["exit_code"] != code:
            print(
                f"  {name}: exit status {code}, expected {expected['exit_code']}", file=sys.stderr
            )
        log.with_suffix(".expected.json").write_text(json.dumps(sidecar, indent=1) + "\n")
        written.append(log)
    return written


def main(names: list[str]) -> None:
    from trainer_wrappers import MORE_SCENARIOS

    chosen = [s for s in [*SCENARIOS, *MORE_SCENARIOS] if not names or s.name in names]
    for scenario in chosen:
        started = time.monotonic()
        paths = write_logs(scenario)
        print(
            f"{scenario.name}: {', '.join(p.name for p in paths)} ({time.monotonic() - started:.0f} s)"
        )
