"""What vtrain supports and refuses, rendered as Markdown from the code's own registries, and
docs/layout.md's list of every module, rendered from the source tree's module docstrings.

README.md, docs/inputs.md and docs/layout.md hold the rendered tables between markers
(``<!-- support-table:start -->`` ... ``<!-- support-table:end -->``, ``refused-flags``,
``modules``); a test renders them again and asserts the files match, so the tables cannot drift from
the code. After a change to a registry or a module, ``make docs`` (``python -m
vtrain_plugin.cli.support_table --write``) rewrites them; ``--check`` exits 1 where a file is stale.

The sources: the spec enums (model families, norms, activations, positions, schedules, software
stacks, precisions, recompute modules, optimizers, FSDP strategies, token dispatchers), the model
features refused on every input path (:mod:`vtrain_plugin.specs.model_features`), the device and
cluster data files, the input kinds :mod:`vtrain_plugin.runs` reads, and Megatron-LM's flag table
(:mod:`vtrain_plugin.specs.megatron.flags`).
"""

from __future__ import annotations

import argparse
import ast
import json
import re
import sys
from collections import Counter
from collections.abc import Iterable
from enum import Enum
from importlib import resources
from pathlib import Path

from vtrain_plugin.hardware.clusters import cluster_preset_names
from vtrain_plugin.runs import LAUNCH_SCRIPT_SUFFIXES
from vtrain_plugin.specs import model_features
from vtrain_plugin.specs.attention import SOFTMAX_TYPES
from vtrain_plugin.specs.fsdp import FsdpImplementation, ShardingStrategy
from vtrain_plugin.specs.hybrid import LAYER_KINDS
from vtrain_plugin.specs.megatron.flags import TABLE, UNSUPPORTED_SCRIPTS, Effect, releases
from vtrain_plugin.specs.model import Activation, Family, Normalization, PositionEmbedding
from vtrain_plugin.specs.optimizer import OptimizerKind
from vtrain_plugin.specs.parallel import RECOMPUTE_MODULES, CpCommType, FlexBackend, Recompute, TokenDispatcher
from vtrain_plugin.specs.training import (
    CUDA_GRAPH_SCOPES, CudaGraphImpl, Fp4Format, Fp4Recipe, Fp8Format, Fp8Recipe, ScheduleKind, SoftwareStack)

ROOT = Path(__file__).resolve().parents[2]
TOP_REASONS = 8  # refused-flag reasons named in README's table; docs/inputs.md lists them all


def _codes(values: Iterable[object]) -> str:
    return ", ".join(f"`{v.value if isinstance(v, Enum) else v}`" for v in values)


def _devices() -> list[dict[str, object]]:
    folder = resources.files("vtrain_plugin.hardware") / "data" / "devices"
    found = [json.loads(entry.read_text(encoding="utf-8")) for entry in folder.iterdir() if entry.name.endswith(".json")]
    return sorted((d for d in found if d.get("architecture") != "cpu"), key=lambda d: str(d["name"]))


def _gpu_cell() -> str:
    parts = []
    for d in _devices():
        note = " (spec sheet only: not calibrated on a measured run)" if d.get("datasheet_only") else ""
        parts.append(f"`{d['name']}` ({d['architecture']}, {d['memory_gibibytes']:g} GiB){note}")
    return "; ".join(parts)


def _effect_counts() -> Counter[Effect]:
    return Counter(flag.effect for flag in TABLE.values())


def _refused_reasons() -> list[tuple[str, int]]:
    counts = Counter(flag.reason for flag in TABLE.values() if flag.effect is Effect.REFUSED)
    return sorted(counts.items(), key=lambda item: (-item[1], item[0]))


def _reasons(*reasons: str) -> str:
    """Refusal reasons of the flag table, each checked to be one still (a reason gone fails the render)."""
    known = dict(_refused_reasons())
    missing = [r for r in reasons if r not in known]
    if missing:
        raise KeyError(f"not a refused-flag reason in flag_effects.csv any more: {missing}")
    return "; ".join(reasons)


def support_rows() -> list[tuple[str, str, str]]:
    """(area, supported, refused) rows, each cell from a registry of the code."""
    positions_refused = ", ".join(model_features.POSITIONS_NOT_MODELLED.values())
    features_refused = ", ".join(f.what for f in model_features.REFUSED)
    counts = _effect_counts()
    accepted = sum(counts[e] for e in (Effect.MODELLED, Effect.VALUE_ONLY, Effect.OUTSIDE_STEP, Effect.IGNORED,
                                       Effect.NO_EFFECT, Effect.SECOND_ORDER))
    refused = sum(counts[e] for e in (Effect.REFUSED, Effect.OTHER_MODEL, Effect.RETIRED))
    top = "; ".join(f"{reason} ({n})" for reason, n in _refused_reasons()[:TOP_REASONS])
    return [
        ("model families", f"{_codes(Family)} presets; any field overridden: norms {_codes(Normalization)}, "
                           f"activations {_codes(Activation)} (gated or not), positions {_codes(PositionEmbedding)}, "
                           "GQA, head dim, biases, dropout, QK layer / L2 norm",
         f"{positions_refused}; {features_refused}"),
        ("model features", "mixture of experts (top-k, shared experts, grouped GEMM, capacity and token dropping, "
                           "router groups, sinkhorn routing), multi-latent attention, multi-token prediction, sliding windows, NoPE layers, "
                           f"softmax {_codes(SOFTMAX_TYPES)}, Mamba hybrids (layers {_codes(LAYER_KINDS)})",
         "`off-by-one` softmax; " + _reasons("DeepSeek sparse attention (DSA)",
                                             "experimental attention variants (gated delta net, DSA)",
                                             "heterogeneous layers", "manifold hyper-connections (mHC)",
                                             "an output gate on attention", "MoE latent projections",
                                             "MTP variants (detached heads, hidden-state mixing, a repeated layer)")),
        ("parallelism", f"TP (+ SP, TP comm overlap), CP {_codes(CpCommType)}, PP (uneven splits, layouts) with "
                        f"schedules {_codes(ScheduleKind)}, DP with the distributed optimizer, FSDP "
                        f"{_codes(FsdpImplementation)} ({_codes(ShardingStrategy)}), EP and expert TP with "
                        f"dispatchers {_codes(TokenDispatcher)} (flex: {_codes(FlexBackend)}), EP all-to-all "
                        f"overlap with delayed wgrad, the distributed optimizer in several instances",
         "HSDP (FSDP in several instances); " + _reasons(
             "context parallelism other than one flat group", "generalised tensor parallelism (GTP) weight sharding",
             "delayed or synchronised gradient reductions and parameter gathers across pipeline stages",
             "a standalone embedding pipeline stage")),
        ("precision", f"`fp16`, `bf16`, `fp32`; FP8 {_codes(Fp8Format)} with recipes {_codes(Fp8Recipe)}; FP4 "
                      f"{_codes(Fp4Format)} ({_codes(Fp4Recipe)}); FP8 weights, bf16 gradient reduction",
         "FP8 on a GPU without FP8 tensor cores; " + _reasons(
             "FP4 parameters (all-gathered in FP4)", "per-module precision overrides",
             "wgrad GEMMs in higher precision under FP8", "a custom FP8 quantizer")),
        ("memory and speed", f"recompute {_codes(Recompute)} (modules {_codes(RECOMPUTE_MODULES)}), CUDA graphs "
                             f"{_codes(CudaGraphImpl)} (scopes {_codes(CUDA_GRAPH_SCOPES)}), deterministic mode, "
                             f"optimizers {_codes(OptimizerKind)} (precision-aware states), fine-grained activation "
                             f"offloading, per-step norm and zero-count logging",
         "other optimizers; " + _reasons("TransformerEngine's layer-level activation offloading", "optimizer offloading",
                                         "the CPU optimizer's copies", "paged stashing of expert activations",
                                         "recompute inputs distributed over TP")),
        ("software stacks", f"{_codes(SoftwareStack)}", "inference-optimized TransformerEngine"),
        ("GPUs", _gpu_cell(), "any other GPU (a device file adds one)"),
        ("cluster presets", _codes(n for n in cluster_preset_names()), "NVLink SHARP (not modelled); " + _reasons("in-network (SHARP) reductions")),
        ("inputs", "plan files (YAML / JSON), vTrain configs (JSON), Megatron-LM launch scripts "
                   f"({', '.join(f'`{s}`' for s in LAUNCH_SCRIPT_SUFFIXES)}), `--megatron-args`, Megatron-Bridge "
                   "YAML, a megatron-core `TransformerConfig` or `GPTModel`, any `torch.nn.Module` with a sample",
         ", ".join(f"`{script}.py` ({what})" for script, what in UNSUPPORTED_SCRIPTS.items())),
        ("Megatron-LM flags", f"{len(TABLE)} flags of releases {releases()[0]} .. {releases()[-1]}: {accepted} accepted "
                              f"({counts[Effect.MODELLED]} modelled, {counts[Effect.VALUE_ONLY]} values only, "
                              f"{counts[Effect.NO_EFFECT] + counts[Effect.OUTSIDE_STEP] + counts[Effect.IGNORED]} "
                              f"without effect on a step, {counts[Effect.SECOND_ORDER]} second-order, warned)",
         f"{refused} refused ({counts[Effect.REFUSED]} unpriced unless at their default, "
         f"{counts[Effect.OTHER_MODEL]} of other models, {counts[Effect.RETIRED]} retired); most: {top}"),
    ]


def render_support_table() -> str:
    lines = ["| area | supported | refused (one line naming it) |", "|---|---|---|"]
    lines += [f"| {area} | {ok} | {no} |" for area, ok, no in support_rows()]
    lines.append("")
    lines.append("Generated from the code's registries by `make docs`; `vtrain flags --effect refused` lists every "
                 "refused flag with its reason.")
    return "\n".join(lines)


def render_refused_flags() -> str:
    lines = ["| reason a flag is refused | flags |", "|---|---|"]
    for reason, _ in _refused_reasons():
        names = sorted(flag.name for flag in TABLE.values() if flag.effect is Effect.REFUSED and flag.reason == reason)
        lines.append(f"| {reason} | {', '.join(f'`{n}`' for n in names)} |")
    return "\n".join(lines)


def render_commands() -> str:
    """The ``vtrain`` commands in the order ``vtrain --help`` lists them, with their help lines."""
    from vtrain_plugin.cli import commands  # the command modules; imported here, not at import time

    lines = ["| command | what it does |", "|---|---|"]
    lines += [f"| `vtrain {command.name}` | {command.help} |" for command in commands().values()]
    return "\n".join(lines)


PACKAGES = ("vtrain_plugin", "megatron_adapters", "profiler")
_ROLE = re.compile(r":\w+:`(~?)([^`]+)`")  # :func:`~a.b` shows b, :func:`a.b` a.b


def module_summary(path: Path) -> str:
    """The first paragraph of the module docstring of ``path`` (what the module is), on one line."""
    doc = ast.get_docstring(ast.parse(path.read_text(encoding="utf-8")))
    if not doc:
        raise ValueError(f"{path}: no module docstring")
    return " ".join(line.strip() for line in doc.strip().split("\n\n")[0].splitlines())


def _markdown(text: str) -> str:
    """reStructuredText roles and literals of a docstring as Markdown code, in a table cell."""
    text = _ROLE.sub(lambda m: f"`{m.group(2).rsplit('.', 1)[-1] if m.group(1) else m.group(2)}`", text)
    text = text.replace("``", "`")
    return text.replace("|", "\\|")


def render_modules() -> str:
    """Every folder of the three packages (its ``__init__``'s summary) and every module in it (its own)."""
    lines = []
    for package in PACKAGES:
        for folder in sorted({path.parent for path in (ROOT / package).rglob("*.py")}):
            init = folder / "__init__.py"
            summary = _markdown(module_summary(init)) if init.exists() else "(a namespace folder)"
            lines += [f"**`{folder.relative_to(ROOT).as_posix()}/`**: {summary}", "",
                      "| module | what it is |", "|---|---|"]
            lines += [f"| `{path.name}` | {_markdown(module_summary(path))} |"
                      for path in sorted(folder.glob("*.py")) if path.name != "__init__.py"]
            lines.append("")
    return "\n".join(lines[:-1])


BLOCKS = {"support-table": render_support_table, "refused-flags": render_refused_flags, "commands": render_commands,
          "modules": render_modules}
FILES = {"README.md": ("support-table", "commands"), "docs/inputs.md": ("refused-flags",),
         "docs/layout.md": ("modules",)}


def replace_block(text: str, name: str, body: str) -> str:
    """``text`` with the lines between ``<!-- NAME:start -->`` and ``<!-- NAME:end -->`` replaced by ``body``."""
    pattern = re.compile(rf"(<!-- {re.escape(name)}:start -->\n).*?(<!-- {re.escape(name)}:end -->)", re.S)
    if not pattern.search(text):
        raise ValueError(f"no <!-- {name}:start --> ... <!-- {name}:end --> markers")
    return pattern.sub(lambda m: m.group(1) + body + "\n" + m.group(2), text, count=1)


def rendered(path: Path, blocks: Iterable[str]) -> str:
    text = path.read_text(encoding="utf-8")
    for name in blocks:
        text = replace_block(text, name, BLOCKS[name]())
    return text


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m vtrain_plugin.cli.support_table", description=__doc__.split("\n")[0])
    parser.add_argument("--write", action="store_true", help="rewrite the tables of README.md, docs/inputs.md and docs/layout.md")
    parser.add_argument("--check", action="store_true", help="exit 1 if a file's tables are stale")
    args = parser.parse_args(argv)
    if not (args.write or args.check):
        sys.stdout.write(render_support_table() + "\n")
        return 0
    stale = []
    for name, blocks in FILES.items():
        path = ROOT / name
        new = rendered(path, blocks)
        if new != path.read_text(encoding="utf-8"):
            stale.append(name)
            if args.write:
                path.write_text(new, encoding="utf-8")
    for name in stale:
        print(f"{name}: {'rewritten' if args.write else 'stale: run make docs'}", file=sys.stderr)
    return 1 if stale and args.check else 0


if __name__ == "__main__":
    raise SystemExit(main())
