"""Result records of a benchmark run and their JSON form.

A run holds its environment (GPU, versions) and an ordered list of measurements; a failed
measurement keeps its error instead of numbers, so a run never loses what it measured.
Ratios between measurements are derived by `infer_bench.analysis`.
"""

from __future__ import annotations

import datetime as _dt
import json
import os
import platform
import subprocess
import sys
from collections.abc import Callable, Collection
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

SCHEMA = "infer-bench/1"
SWEEP_KIND = "acceptance_sweep"  # speculation at controlled acceptance (bench/sweep.py)
PEER_KINDS = {"hf": "HF", "gpt-fast": "gpt-fast"}  # peer measurements -> their label in reports
STATUSES = ("ok", "error", "skipped")


@dataclass
class Measurement:
    name: str  # unique within a run, e.g. "w1/3b/ours"
    kind: str  # "bandwidth" | "roofline" | "engine" | "hf" | "spec_costs" | "projection" | SWEEP_KIND ...
    group: str = ""  # measurements shown in one table share a group
    params: dict[str, Any] = field(default_factory=dict)
    metrics: dict[str, Any] = field(default_factory=dict)
    status: str = "ok"
    error: str | None = None
    elapsed_s: float = 0.0
    refs: dict[str, str] = field(default_factory=dict)  # role -> measurement name ("baseline", "roofline", "costs")
    derived: dict[str, Any] = field(default_factory=dict)  # ratios to the refs (infer_bench.analysis)

    def __post_init__(self) -> None:
        if self.status not in STATUSES:
            raise ValueError(f"measurement status must be one of {STATUSES}, got {self.status!r}")

    @property
    def ok(self) -> bool:
        return self.status == "ok"

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> Measurement:
        return cls(**raw)


@dataclass
class BenchRun:
    suite: str
    environment: dict[str, Any] = field(default_factory=dict)
    measurements: list[Measurement] = field(default_factory=list)
    options: dict[str, Any] = field(default_factory=dict)
    created: str = field(default_factory=lambda: _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"))
    schema: str = SCHEMA

    def add(self, measurement: Measurement) -> Measurement:
        if any(m.name == measurement.name for m in self.measurements):
            raise ValueError(f"duplicate measurement name {measurement.name!r} in one run")
        self.measurements.append(measurement)
        return measurement

    def get(self, name: str) -> Measurement | None:
        return next((m for m in self.measurements if m.name == name), None)

    def groups(self, kinds: Collection[str], keep: Callable[[Measurement], bool] | None = None
               ) -> dict[str, list[Measurement]]:
        """The measurements of these kinds (that `keep` takes) by group, in run order."""
        groups: dict[str, list[Measurement]] = {}
        for m in self.measurements:
            if m.kind in kinds and (keep is None or keep(m)):
                groups.setdefault(m.group, []).append(m)
        return groups

    def to_dict(self) -> dict[str, Any]:
        return {"schema": self.schema, "suite": self.suite, "created": self.created, "options": self.options,
                "environment": self.environment, "measurements": [m.to_dict() for m in self.measurements]}

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> BenchRun:
        if raw.get("schema") != SCHEMA:
            raise ValueError(f"not an infer benchmark result (schema {raw.get('schema')!r}, expected {SCHEMA!r})")
        return cls(suite=raw["suite"], environment=raw.get("environment", {}),
                   measurements=[Measurement.from_dict(m) for m in raw.get("measurements", [])],
                   options=raw.get("options", {}), created=raw.get("created", ""), schema=raw["schema"])


def save_run(run: BenchRun, path: str | os.PathLike[str]) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(run.to_dict(), indent=1, default=_jsonable) + "\n", encoding="utf-8")
    tmp.replace(path)  # a reader never sees half a file (the run saves after every measurement)
    return path


def load_run(path: str | os.PathLike[str]) -> BenchRun:
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"benchmark result {str(path)!r} does not exist")
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path} is not valid JSON ({exc})") from exc
    return BenchRun.from_dict(raw)


def _jsonable(value: object) -> object:
    if isinstance(value, (torch.dtype, torch.device, Path)):
        return str(value)
    if isinstance(value, tuple):
        return list(value)
    raise TypeError(f"cannot store {type(value).__name__} in a benchmark result")


def environment_info(device: torch.device | str) -> dict[str, Any]:
    """GPU name and versions: what a reader needs to compare numbers across runs."""
    device = torch.device(device)
    info: dict[str, Any] = {
        "device": str(device), "python": platform.python_version(), "torch": torch.__version__,
        "cuda": torch.version.cuda, "platform": platform.platform(), "cpu_count": os.cpu_count(),
        "transformers": _version("transformers"), "infer_commit": _git_commit(),
        "argv": sys.argv[1:],
    }
    if device.type == "cuda" and torch.cuda.is_available():
        index = device.index if device.index is not None else torch.cuda.current_device()
        props = torch.cuda.get_device_properties(index)
        info.update(gpu=props.name, gpu_memory_gb=round(props.total_memory / 1e9, 1),
                    gpu_capability=f"{props.major}.{props.minor}", gpu_count=torch.cuda.device_count(),
                    cudnn=torch.backends.cudnn.version())
    else:
        info["gpu"] = None
    return info


def _version(package: str) -> str | None:
    try:
        from importlib.metadata import version
        return version(package)
    except Exception:  # not installed
        return None


def _git_commit() -> str | None:
    """The checkout's commit; INFER_COMMIT wins (a copied tree without .git, e.g. a GPU box)."""
    if os.environ.get("INFER_COMMIT"):
        return os.environ["INFER_COMMIT"]
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, timeout=5,
                             cwd=Path(__file__).resolve().parent)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() or None if out.returncode == 0 else None
