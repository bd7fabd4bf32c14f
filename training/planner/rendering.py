"""The memory plan as a result: its items (bytes, where, formula, phases), the verdict, the suggestions,
and its renderings (text for `ulyssesctl plan`, dict for JSON).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any, Protocol

from .inputs import (
    Cluster,
    GiB,
    ZeroSettings,
)

# Override keys of a suggestion that change the hardware or the experiment: advice, never applied by the daemon.
ADVICE_KEYS = ("cluster.", "train.seq_len", "parallel.", "model.preset", "model.hidden_size", "model.num_layers")


def is_advice(overrides: dict[str, Any]) -> bool:
    """Whether a suggestion changes the hardware or the experiment (model, sequence, SP/DP layout)."""
    return any(k.startswith(ADVICE_KEYS) for k in overrides)


# ------------------------------------------------------------------------------------- plan


class FixLike(Protocol):
    """What a plan shows of a fix (fixes.Fix; fixes.py imports this module, not the reverse)."""

    def describe(self) -> str: ...
    def to_dict(self) -> dict[str, Any]: ...


@dataclass(frozen=True)
class Item:
    name: str                 # what it is
    bytes: int                # per GPU (where=gpu) or per node (host, nvme)
    where: str                # gpu | host | nvme
    formula: str              # how it was computed
    phases: tuple[str, ...] = ("loss", "backward", "step")  # GPU phases during which it is allocated
    off: str = ""             # the setting that removes it (named when the host is short); "" = none
    # Held on the GPU by another process (the warm standby), not by the job's allocator: in gpu_required,
    # never in the allocated phases (which predict the job's max_memory_allocated).
    outside_allocator: bool = False


PHASES = ("loss", "backward", "step")
PHASE_DOC = {"loss": "end of forward / start of backward (logits + loss alive)",
             "backward": "backward through the last checkpointed chunk (recomputed activations alive)",
             "step": "optimizer step (activations freed; GPU Adam: fp32 grad + temp of one sub-group)"}


@dataclass
class Suggestion:
    changes: list[str]                 # human-readable changes
    overrides: dict[str, Any]          # machine-readable: dotted spec/cluster keys -> new value
    cost: float                        # relative cost (see MOVE_COSTS); lower first
    gpu_required_gib: float
    host_required_gib: float
    nvme_required_gib: float
    gpu_margin_gib: float

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class Plan:
    cluster: Cluster
    zero: ZeroSettings
    summary: dict[str, Any]            # model/parallel/batch facts the plan used
    items: list[Item]
    phase_bytes: dict[str, int]        # allocated GPU bytes per phase
    gpu_peak_allocated: int            # predicted torch.cuda.max_memory_allocated() per GPU
    gpu_required: int                  # peak + allocator headroom + CUDA context + items outside the allocator
    host_required: int                 # per node
    nvme_required: int                 # per node
    fits: bool
    problems: list[str]
    notes: list[str]
    deepspeed_view: dict[str, int]     # model states in DeepSpeed's estimator accounting (for comparison)
    suggestions: list[Suggestion] = field(default_factory=list)   # search.py: every kind of change (advice too)
    fixes: Sequence[FixLike] = field(default_factory=list)   # fixes.py: experiment- and hardware-preserving, cheapest first
    fix_search: str = ""                             # how the fixes were searched (plans, exhaustive or not)
    fix_search_complete: bool = True                 # False: the plan budget stopped it (a fit may exist beyond)

    @property
    def peak_phase(self) -> str:
        return max(self.phase_bytes, key=lambda k: self.phase_bytes[k])

    @property
    def gpu_margin_gib(self) -> float:
        return self.cluster.gpu_mem_gib - self.gpu_required / GiB

    @property
    def host_margin_gib(self) -> float:
        return self.cluster.host_mem_gib - self.host_required / GiB

    def item(self, name: str) -> Item:
        for it in self.items:
            if it.name == name:
                return it
        raise KeyError(name)

    def bytes_of(self, name: str) -> int:
        """Bytes of an item, 0 if this plan has no such item."""
        return next((it.bytes for it in self.items if it.name == name), 0)

    def to_dict(self) -> dict[str, Any]:
        return {
            "fits": self.fits,
            "verdict": "fits" if self.fits else "does not fit",
            "cluster": asdict(self.cluster),
            "zero": {k: v for k, v in asdict(self.zero).items() if k != "model_persistence_threshold"},
            "summary": self.summary,
            "items": [{**asdict(it), "gib": it.bytes / GiB} for it in self.items],
            "phases_gib": {k: v / GiB for k, v in self.phase_bytes.items()},
            "peak_phase": self.peak_phase,
            "gpu_peak_allocated_gib": self.gpu_peak_allocated / GiB,
            "gpu_required_gib": self.gpu_required / GiB,
            "gpu_capacity_gib": self.cluster.gpu_mem_gib,
            "gpu_margin_gib": self.gpu_margin_gib,
            "host_required_gib": self.host_required / GiB,
            "host_capacity_gib": self.cluster.host_mem_gib,
            "host_margin_gib": self.host_margin_gib,
            "nvme_required_gib": self.nvme_required / GiB,
            "nvme_capacity_gib": self.cluster.nvme_gib,
            "problems": self.problems,
            "notes": self.notes,
            "deepspeed_view": self.deepspeed_view,
            "fixes": [f.to_dict() for f in self.fixes],
            "fix_search": self.fix_search,
            "fix_search_complete": self.fix_search_complete,
            "suggestions": [{**s.to_dict(), "advice": is_advice(s.overrides)} for s in self.suggestions],
        }

    def render(self) -> str:
        s = self.summary
        lines = [
            f"Memory plan: {s['model']} ({s['params'] / 1e9:.2f}B params), {s['dtype']}, seq {s['seq_len']} "
            f"(SP {s['sp']} -> {s['seq_local']} tokens/GPU), micro-batch {s['micro_batch']}, "
            f"checkpointing {s['checkpointing']}",
            f"Cluster: {self.cluster.describe()}; ZeRO-3 over {s['zero_partitions']} GPUs (DP {s['dp']} x SP {s['sp']}); "
            f"offload optimizer={self.zero.offload_optimizer} param={self.zero.offload_param}",
            *([f"Figures: {self.cluster.origin}"] if self.cluster.origin else []),
            "",
            f"{'per GPU':<46} {'GiB':>9}  {'GB':>8}  phases            formula",
        ]
        def gpu_row(it: Item) -> str:
            ph = ",".join(it.phases) if it.phases != PHASES else "all"
            return f"  {it.name:<44} {it.bytes / GiB:9.2f}  {it.bytes / 1e9:8.2f}  {ph:<17} {it.formula}"

        lines += [gpu_row(it) for it in self.items if it.where == "gpu" and not it.outside_allocator]
        for ph in PHASES:
            mark = "  <- peak" if ph == self.peak_phase else ""
            lines.append(f"  {'= allocated, ' + ph:<44} {self.phase_bytes[ph] / GiB:9.2f}  "
                         f"{self.phase_bytes[ph] / 1e9:8.2f}  {PHASE_DOC[ph]}{mark}")
        # Other processes' memory on the GPU comes after the job's allocated sums: it is not part of them.
        others = [it for it in self.items if it.where == "gpu" and it.outside_allocator]
        lines += [gpu_row(it) for it in others]
        label = "required (+headroom, CUDA context" + (", standby)" if others else ")")
        lines.append(f"  {label:<44} {self.gpu_required / GiB:9.2f}  "
                     f"{self.gpu_required / 1e9:8.2f}  capacity {self.cluster.gpu_mem_gib:.2f} GiB, "
                     f"margin {self.gpu_margin_gib:+.2f} GiB")
        lines += ["", f"{'per host (node)':<46} {'GiB':>9}  {'GB':>8}"]
        for it in (i for i in self.items if i.where in ("host", "nvme")):
            tag = " [NVMe]" if it.where == "nvme" else ""
            lines.append(f"  {(it.name + tag):<44} {it.bytes / GiB:9.1f}  {it.bytes / 1e9:8.1f}  {it.formula}")
        lines.append(f"  {'required host RAM':<44} {self.host_required / GiB:9.1f}  {self.host_required / 1e9:8.1f}  "
                     f"capacity {self.cluster.host_mem_gib:.0f} GiB, margin {self.host_margin_gib:+.1f} GiB")
        if self.nvme_required:
            lines.append(f"  {'required NVMe':<44} {self.nvme_required / GiB:9.1f}  {self.nvme_required / 1e9:8.1f}  "
                         f"capacity {self.cluster.nvme_gib:.0f} GiB")
        lines += ["", "VERDICT: " + ("FITS" if self.fits else "DOES NOT FIT")]
        lines += [f"  - {p}" for p in self.problems]
        if self.notes:
            lines += ["Notes:"] + [f"  - {n}" for n in self.notes]
        if not self.fits:
            n = 0
            if self.fixes:
                lines.append("Fixes that keep the experiment and the hardware (cheapest predicted step time first, "
                             f"then fewest changes; each re-planned; {self.fix_search}):")
                for n, fx in enumerate(self.fixes, 1):
                    lines.append(f"  {n}. {fx.describe()}")
            elif self.fix_search and not self.fix_search_complete:
                lines.append(f"SEARCH INCOMPLETE: no fix found before the plan budget ran out, but one may exist "
                             f"({self.fix_search}); do not read this as 'nothing fits'.")
            elif self.fix_search:
                lines.append(f"No fix that keeps the experiment and the hardware fits ({self.fix_search}).")
            # With fixes found, the other list shows only what they cannot: hardware or experiment changes (the
            # fix search has the daemon's [restart]/[checkpoint] switches among its levers).
            rest = [sg for sg in self.suggestions if not self.fixes or is_advice(sg.overrides)]
            if rest:
                lines.append("Other changes that would fit (hardware and experiment changes are advice: the daemon "
                             "never applies them; relative cost, cheapest first):")
                for i, sg in enumerate(rest, n + 1):
                    lines.append(f"  {i}. {' + '.join(sg.changes)}  -> GPU {sg.gpu_required_gib:.1f} GiB "
                                 f"(margin {sg.gpu_margin_gib:+.1f}), host {sg.host_required_gib:.0f} GiB/node"
                                 + (f", NVMe {sg.nvme_required_gib:.0f} GiB/node" if sg.nvme_required_gib else "")
                                 + f"  [cost {sg.cost:g}]")
            if not rest and not self.fixes:
                lines.append("No candidate change found that fits.")
        return "\n".join(lines)
