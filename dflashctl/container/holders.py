"""Which live runs of a container hold which GPUs: every process there that carries a
run's environment (DFLASH_RUN_ID, DFLASH_RUN_DIR) and its CUDA_VISIBLE_DEVICES (none:
every GPU), whatever workdir launched it. Read from /proc in the container, so runs
of other configs sharing the container count too."""

from __future__ import annotations

from dataclasses import dataclass

from dflashctl.errors import HostError
from dflashctl.remote.deploy_target import Target

_PROBE = r"""for f in /proc/[0-9]*/environ; do
  tr '\000' '\n' < "$f" 2>/dev/null | awk '
    index($0, "DFLASH_RUN_ID=") == 1 { r = substr($0, 15) }
    index($0, "DFLASH_RUN_DIR=") == 1 { d = substr($0, 16) }
    index($0, "CUDA_VISIBLE_DEVICES=") == 1 { g = substr($0, 22); s = 1 }
    END { if (r != "") print r "|" (s ? g : "*") "|" d }'
done | sort -u
"""


@dataclass(frozen=True)
class Holder:
    run_id: str
    gpus: tuple[int, ...] | None  # None: every GPU (no CUDA_VISIBLE_DEVICES)
    run_dir: str

    def describe_gpus(self) -> str:
        return "every GPU" if self.gpus is None else "GPU " + ",".join(map(str, self.gpus))

    def overlaps(self, gpus: list[int] | None) -> list[int] | None:
        """The GPUs of `gpus` (None: every one) this run holds too; None when none."""
        if gpus is None or self.gpus is None:
            return list(gpus if gpus is not None else self.gpus or []) or None
        common = sorted(set(gpus) & set(self.gpus))
        return common or None

    def to_json(self) -> dict:
        return {"run_id": self.run_id, "gpus": self.gpus, "run_dir": self.run_dir}


def parse(text: str) -> list[Holder]:
    found = []
    for line in text.splitlines():
        parts = line.split("|", 2)
        if len(parts) != 3 or not parts[0]:
            continue
        gpus = None
        if parts[1] != "*":
            gpus = tuple(int(g) for g in parts[1].split(",") if g.strip().isdigit())
        found.append(Holder(parts[0], gpus, parts[2]))
    return sorted(set(found), key=lambda h: h.run_id)


def live_holders(target: Target) -> list[Holder]:
    return parse(target.run(["sh", "-c", _PROBE], check=False).stdout_text)


def refuse_if_held(target: Target, workdir: str, gpus: list[int] | None) -> None:
    """Before a deploy stops anything: a live run launched from another workdir that
    holds any of `gpus` stops it, naming that run."""
    prefix = workdir.rstrip("/") + "/"
    for holder in live_holders(target):
        if holder.run_dir.startswith(prefix):
            continue  # this workdir's own run: the deploy replaces it
        common = holder.overlaps(gpus)
        if common is not None:
            where = holder.run_dir.rsplit("/runs/", 1)[0]
            raise HostError(
                f"GPU {','.join(map(str, common))} of {target.describe()} is held by run "
                f"{holder.run_id} (workdir {where}, {holder.describe_gpus()}): nothing "
                "was stopped",
                hint="pick other GPUs with run.gpus, or stop that run first "
                "(dflashctl stop with its config)",
            )
