"""What a finished run left behind, read from its log as it streams past.

The bundled trainer ends with lines like

    final loss 4.7542
    eval | tau 1.28 | lossless yes | 128 tokens | 1.3 tokens/target forward
    drafter checkpoint: /root/dflash/runs/<id>/outputs/checkpoints/step-000240

so the follower can say where the checkpoint is and how good the drafter got without
the user digging through the log. Any trainer that prints the same shapes benefits;
one that prints none of them simply gets no summary.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

_FINAL_LOSS = re.compile(r"^final loss (?P<loss>\S+)")
_STEP_LOSS = re.compile(r"^step (?P<step>\d+)/(?P<total>\d+) \| loss (?P<loss>\S+)")
_EVAL = re.compile(
    r"^eval \| tau (?P<tau>[\d.]+) \| lossless (?P<lossless>\w+)[^|]* \| (?P<tokens>\d+) tokens"
    r"(?: \| (?P<per_forward>[\d.]+) tokens/target forward)?"
)
_CHECKPOINT = re.compile(r"^(?:drafter )?checkpoint: (?P<path>\S.*?)(?: \([\d.]+ s\))?$")


@dataclass
class RunSummary:
    final_loss: float | None = None
    last_step: str | None = None  # "240/240"
    tau: float | None = None
    lossless: bool | None = None
    eval_tokens: int | None = None
    tokens_per_target_forward: float | None = None
    checkpoint: str | None = None

    def feed(self, line: str) -> None:
        # Cheap first-character test: this runs on every log line.
        head = line[:1]
        if head not in ("f", "s", "e", "d", "c"):
            return
        if m := _STEP_LOSS.match(line):
            self.last_step = f"{m['step']}/{m['total']}"
            self.final_loss = _number(m["loss"])
        elif m := _FINAL_LOSS.match(line):
            self.final_loss = _number(m["loss"])
        elif m := _EVAL.match(line):
            self.tau = float(m["tau"])
            self.lossless = m["lossless"] == "yes"
            self.eval_tokens = int(m["tokens"])
            if m["per_forward"]:
                self.tokens_per_target_forward = float(m["per_forward"])
        elif m := _CHECKPOINT.match(line):
            self.checkpoint = m["path"].strip()

    @property
    def empty(self) -> bool:
        return all(value is None for value in self.to_json().values())

    def to_json(self) -> dict[str, Any]:
        return {
            "final_loss": self.final_loss,
            "last_step": self.last_step,
            "tau": self.tau,
            "lossless": self.lossless,
            "eval_tokens": self.eval_tokens,
            "tokens_per_target_forward": self.tokens_per_target_forward,
            "checkpoint": self.checkpoint,
        }

    def describe(self) -> list[str]:
        """Human lines, only for what the log told us."""
        lines = []
        if self.checkpoint:
            lines.append(f"checkpoint  {self.checkpoint}")
        results = []
        if self.final_loss is not None:
            results.append(f"final loss {self.final_loss:.4g}")
        if self.tau is not None:
            lossless = (
                "" if self.lossless is None else f", lossless {'yes' if self.lossless else 'NO'}"
            )
            results.append(f"eval tau {self.tau:.2f}{lossless}")
        if results:
            lines.append("result      " + " · ".join(results))
        return lines


def _number(text: str) -> float | None:
    try:
        return float(text)
    except ValueError:
        return None  # "nan" parses; other words (e.g. "n/a") do not
