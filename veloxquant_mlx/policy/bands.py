"""The fact space cut into bands at a policy's thresholds, and concrete witnesses for cells.

Every condition compares one fact with constants. Between two consecutive constants of a fact
(and at each constant itself) every comparison keeps its truth value, so the policy's decision
is constant on each cell of the product of bands: evaluating one witness per cell decides the
whole fact space exactly (no sampling). Integer facts are banded on the integer lattice,
head_dim on powers of two, pressure_fraction on the reals (> 0), and nullable facts get a
band of their own for null.

Derived facts (fp16_kv_bytes, pressure_fraction) couple the dimensions, so a cell is only a
candidate: witness() searches for a WorkloadSpec + HardwareInfo whose facts fall in every band
of the cell, and a cell without one is reported as infeasible (not decided, not a gap). The
search tries each band's ends and solves the derived facts for a free variable; it can miss a
witness for very narrow combinations of derived bands, which lint reports as a count.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass
from fractions import Fraction

from veloxquant_mlx.config.hardware import HardwareInfo
from veloxquant_mlx.config.workload import WorkloadSpec
from veloxquant_mlx.errors import PolicyError
from veloxquant_mlx.policy.facts import FACTS, facts_of

MAX_CELLS = 50_000  # about 5 s of lint on a loaded 2-core machine

# Values used for a fact a cell leaves free (a typical mid-size workload).
_TYPICAL = {"head_dim": 128, "seq_len": 4096, "n_layers": 32, "batch_size": 1,
            "active_memory_bytes": 0, "total_memory_bytes": None}


@dataclass(frozen=True)
class Band:
    """One band of one fact. Integers: lo..hi inclusive (hi None = unbounded). Floats: an
    interval with open/closed ends. null: the fact is null."""

    fact: str
    null: bool = False
    lo: float | None = None
    hi: float | None = None
    lo_closed: bool = True
    hi_closed: bool = True

    def contains(self, value) -> bool:
        if value is None or self.null:
            return value is None and self.null
        if self.lo is not None and (value < self.lo or (value == self.lo and not self.lo_closed)):
            return False
        if self.hi is not None and (value > self.hi or (value == self.hi and not self.hi_closed)):
            return False
        return True


def _int_bands(name: str, thresholds) -> list:
    spec = FACTS[name]
    low = int(spec.minimum)
    starts = {low}
    for t in thresholds:
        # For an integer x, x<t, x==t, x>t flip at ceil(t) and floor(t)+1.
        for s in (math.ceil(t), math.floor(t) + 1):
            if s > low:
                starts.add(s)
    starts = sorted(starts)
    bands = []
    for i, start in enumerate(starts):
        end = starts[i + 1] - 1 if i + 1 < len(starts) else None
        if spec.power_of_two and _smallest_power_of_two(start, end) is None:
            continue  # no head_dim lives here
        bands.append(Band(name, lo=start, hi=end))
    return bands


def _float_bands(name: str, thresholds) -> list:
    low = float(FACTS[name].minimum)
    points = sorted({float(t) for t in thresholds if t > low})
    bands = []
    previous = low
    for point in points:
        bands.append(Band(name, lo=previous, hi=point, lo_closed=False, hi_closed=False))
        bands.append(Band(name, lo=point, hi=point))
        previous = point
    bands.append(Band(name, lo=previous, hi=None, lo_closed=False, hi_closed=False))
    return bands


def bands_of(name: str, thresholds) -> list:
    spec = FACTS[name]
    bands = [Band(name, null=True)] if spec.nullable else []
    if spec.kind == "int":
        bands += _int_bands(name, thresholds)
    else:
        bands += _float_bands(name, thresholds)
    return bands


def _smallest_power_of_two(lo, hi):
    p = 1 << max(0, math.ceil(math.log2(max(lo, 1))))
    while p < lo:
        p <<= 1
    return p if hi is None or p <= hi else None


def _candidates(band: Band | None, name: str) -> list:
    """A few values of a primary fact inside its band (the ends, a typical value)."""
    if band is None:
        return [_TYPICAL[name]]
    if band.null:
        return [None]
    spec = FACTS[name]
    values = []
    if spec.power_of_two:
        first = _smallest_power_of_two(band.lo, band.hi)
        values.append(first)
        if band.hi is not None:
            values.append(1 << int(math.floor(math.log2(band.hi))))
        else:
            values.append(first * 2)
    else:
        values.append(int(band.lo))
        values.append(int(band.hi) if band.hi is not None else int(band.lo) * 2 + 1)
    typical = _TYPICAL[name]
    if typical is not None and band.contains(typical):
        values.insert(0, typical)
    return list(dict.fromkeys(values))


def _pressure_targets(band: Band) -> list:
    if band.lo == band.hi:
        return [Fraction(band.lo)]
    if band.hi is None:
        return [Fraction(band.lo) + 1, Fraction(band.lo) * 2 + Fraction(1, 2)]
    return [(Fraction(band.lo) + Fraction(band.hi)) / 2]


def _memory_options(f: int, cell: dict):
    """(total, active) pairs to try for an fp16 size f."""
    p_band = cell.get("pressure_fraction")
    t_band = cell.get("total_memory_bytes")
    actives = _candidates(cell.get("active_memory_bytes"), "active_memory_bytes")
    if p_band is not None and p_band.null or (t_band is not None and t_band.null):
        for a in actives:
            yield None, a
        return
    if p_band is None:
        for total in _candidates(t_band, "total_memory_bytes"):
            for a in actives:
                yield total, a
        return
    for target in _pressure_targets(p_band):
        num, den = target.numerator, target.denominator
        for a in actives:
            # (a + f) / T == num / den exactly when a + f is a multiple of num.
            a2 = a + (-(a + f)) % num
            for a_try in (a, a2):
                yield (a_try + f) * den // num, a_try
                yield (a_try + f) * den // num + 1, a_try
        for total in _candidates(t_band, "total_memory_bytes") if t_band is not None else []:
            if total:
                a = math.floor(target * total) - f
                for a_try in (a, a + 1):
                    if a_try >= 0:
                        yield total, a_try


def _fp16_options(shape: tuple, cell: dict):
    """(head_dim, seq_len, n_layers, batch_size) tuples, solving fp16_kv_bytes's band for one
    free variable when the cell constrains it."""
    yield shape
    band = cell.get("fp16_kv_bytes")
    if band is None:
        return
    names = ("head_dim", "seq_len", "n_layers", "batch_size")
    for i in (2, 3, 1):  # n_layers, batch_size, seq_len: any positive integer
        rest = 4
        for j, value in enumerate(shape):
            if j != i:
                rest *= value
        need_lo = math.ceil(band.lo / rest) if band.lo is not None else 1
        own = cell.get(names[i])
        for value in (need_lo, need_lo + 1, math.floor(band.hi / rest) if band.hi is not None else need_lo):
            if value >= 1 and (own is None or own.contains(value)):
                yield shape[:i] + (value,) + shape[i + 1:]


def witness(cell: dict):
    """(WorkloadSpec, HardwareInfo, facts) whose facts lie in every band of cell, or None."""
    shapes = itertools.product(*(_candidates(cell.get(name), name)
                                 for name in ("head_dim", "seq_len", "n_layers", "batch_size")))
    for shape in shapes:
        for hd, s, n, b in _fp16_options(shape, cell):
            f = 4 * hd * s * n * b
            if "fp16_kv_bytes" in cell and not cell["fp16_kv_bytes"].contains(f):
                continue
            for total, active in _memory_options(f, cell):
                if total is not None and total < 1 or active < 0:
                    continue
                workload = WorkloadSpec(head_dim=hd, seq_len=s, n_layers=n, batch_size=b)
                hardware = HardwareInfo(total_memory_bytes=total, active_memory_bytes=active)
                try:
                    facts = facts_of(workload, hardware)
                except OverflowError:  # thresholds near 1e308: the pressure is no float
                    continue
                if all(band.contains(facts[name]) for name, band in cell.items()):
                    return workload, hardware, facts
    return None


def cells(dims: dict):
    """Every cell of the product of bands: yields (index tuple, {fact: band})."""
    names = list(dims)
    count = 1
    for name in names:
        count *= len(dims[name])
    if count > MAX_CELLS:
        raise PolicyError(f"the policy cuts the fact space into {count} cells: analysis allows at "
                          f"most {MAX_CELLS}; use fewer distinct thresholds")
    for index in itertools.product(*(range(len(dims[name])) for name in names)):
        yield index, {name: dims[name][i] for name, i in zip(names, index)}


def dims_of(thresholds: dict, facts=None) -> dict:
    """fact -> bands, for the facts given (default: those with thresholds), in FACTS order."""
    wanted = set(thresholds) if facts is None else set(facts)
    return {name: bands_of(name, thresholds.get(name, ())) for name in FACTS if name in wanted}


# ---- regions: merging cells into readable bands ------------------------------------------


def merge_regions(labelled: dict) -> list:
    """labelled: index tuple -> label. Returns [(label, ((lo, hi) per dim))] where runs of
    adjacent cells with the same label are merged, one dimension after the other."""
    regions = [(label, tuple((i, i) for i in index)) for index, label in labelled.items()]
    if not regions:
        return []
    n_dims = len(regions[0][1])
    changed = True
    while changed:
        changed = False
        for dim in range(n_dims):
            groups: dict = {}
            for label, ranges in regions:
                key = (repr(label), ranges[:dim] + ranges[dim + 1:])
                groups.setdefault(key, []).append((label, ranges))
            merged = []
            for members in groups.values():
                members.sort(key=lambda item: item[1][dim][0])
                current = members[0]
                for item in members[1:]:
                    if item[1][dim][0] == current[1][dim][1] + 1:
                        ranges = list(current[1])
                        ranges[dim] = (current[1][dim][0], item[1][dim][1])
                        current = (current[0], tuple(ranges))
                        changed = True
                    else:
                        merged.append(current)
                        current = item
                merged.append(current)
            regions = merged
    regions.sort(key=lambda item: item[1])
    return regions


def _number(value) -> str:
    if isinstance(value, float) and value.is_integer() and abs(value) < 1e15:
        value = int(value)
    return str(value) if not isinstance(value, float) else f"{value:g}"


def describe_range(name: str, bands: list, lo: int, hi: int) -> str | None:
    """Readable text of bands[lo..hi] of one fact; None when it is the whole domain."""
    if lo == 0 and hi == len(bands) - 1:
        return None
    chosen = bands[lo:hi + 1]
    parts = []
    if chosen[0].null:
        parts.append(f"{name} is null")
        chosen = chosen[1:]
    if chosen:
        first, last = chosen[0], chosen[-1]
        spec = FACTS[name]
        if spec.kind == "int":
            low, high = first.lo, last.hi
            if high is not None and low == high:
                text = f"{name} == {low}"
            elif high is None:
                text = f"{name} >= {low}"
            elif low == int(spec.minimum):
                text = f"{name} < {high + 1}"
            else:
                text = f"{low} <= {name} < {high + 1}"
        else:
            starts_at_domain = first.lo is None or (first.lo == spec.minimum and not first.lo_closed)
            lo_text = "" if starts_at_domain else f"{_number(first.lo)} {'<=' if first.lo_closed else '<'} "
            hi_text = (f" {'<=' if last.hi_closed else '<'} {_number(last.hi)}"
                       if last.hi is not None else "")
            if first.lo is not None and first.lo == last.hi and first.lo_closed and last.hi_closed:
                text = f"{name} == {_number(first.lo)}"
            else:
                text = f"{lo_text}{name}{hi_text}" if (lo_text or hi_text) else f"{name} is known"
        parts.append(text)
    return " or ".join(parts) if len(parts) == 1 else "(" + " or ".join(parts) + ")"


def describe_region(dims: dict, ranges: tuple) -> str:
    texts = [describe_range(name, dims[name], lo, hi) for name, (lo, hi) in zip(dims, ranges)]
    texts = [t for t in texts if t]
    return " and ".join(texts) if texts else "every workload"


def workload_flags(workload: WorkloadSpec, hardware: HardwareInfo) -> str:
    """The CLI flags that reproduce a witness."""
    flags = (f"--head-dim {workload.head_dim} --seq-len {workload.seq_len} "
             f"--n-layers {workload.n_layers} --batch-size {workload.batch_size}")
    if hardware.total_memory_bytes:
        flags += (f" --total-memory-bytes {hardware.total_memory_bytes} "
                  f"--active-memory-bytes {hardware.active_memory_bytes}")
    else:
        flags += " --unknown-memory" + (f" --active-memory-bytes {hardware.active_memory_bytes}"
                                        if hardware.active_memory_bytes else "")
    return flags
