"""The gradient buckets all-reduced during the backward (`plan_buckets`) and the ZeRO-1 shards
(`zero_shards`) of the flat gradient region."""
from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

ALIGN = 4                   # elements: shard starts stay 16-byte aligned for the float4 kernels


@dataclass(frozen=True)
class Bucket:
    index: int
    point: object       # the backward's hook point after which all its tensors are final
    names: tuple        # its tensors, in production order
    spans: tuple        # ((start, stop), ...) element ranges of the flat region, ascending, merged

    @property
    def numel(self) -> int:
        return sum(b - a for a, b in self.spans)


def tensor_extents(table) -> dict:
    """name -> (start, stop) in the flat region: the tensor and the padding after it (up to the next
    tensor, or the end of the region), so the extents tile [0, table.total) exactly."""
    specs = sorted(table, key=lambda s: s.offset)
    out = {}
    for i, s in enumerate(specs):
        stop = specs[i + 1].offset if i + 1 < len(specs) else table.total
        out[s.name] = (s.offset, stop)
    if specs and specs[0].offset != 0:
        first = specs[0]
        out[first.name] = (0, out[first.name][1])
    return out


_LAYER_ORDER = ("fcproj.w", "fcproj.b", "fc.w", "fc.b", "ln2.w", "ln2.b",
                "proj.w", "proj.b", "attn.w", "attn.b", "ln1.w", "ln1.b")


def production_order(table) -> list:
    """[(point, [names])] in the order model.backward() finishes them: the final layernorm ("head"),
    layers L-1 .. 0 (point = the layer index), then the embeddings ("embed": wte, which the tied head
    also writes, and wpe, written last by encoder_bwd). A tensor this list does not know is put at
    "embed", the end of the backward, where every gradient is final."""
    names = [s.name for s in table]
    layers = defaultdict(list)
    head, embed, rest = [], [], []
    for n in names:
        if n.startswith("h") and "." in n and n[1:n.index(".")].isdigit():
            layers[int(n[1:n.index(".")])].append(n)
        elif n.startswith("lnf."):
            head.append(n)
        elif n in ("wte", "wpe"):
            embed.append(n)
        else:
            rest.append(n)
    rank = {k: i for i, k in enumerate(_LAYER_ORDER)}
    order = [("head", sorted(head))]
    for l in sorted(layers, reverse=True):
        known = [n for n in layers[l] if n.split(".", 1)[1] in rank]
        unknown = [n for n in layers[l] if n.split(".", 1)[1] not in rank]
        order.append((l, sorted(known, key=lambda n: rank[n.split(".", 1)[1]])))
        rest += unknown
    order.append(("embed", embed + rest))
    return [(p, ns) for p, ns in order if ns]


def _merge(extents) -> tuple:
    spans = []
    for a, b in sorted(extents):
        if spans and spans[-1][1] == a:
            spans[-1] = (spans[-1][0], b)
        else:
            spans.append((a, b))
    return tuple(spans)


def plan_buckets(table, cap_elems: int) -> list:
    """Buckets of whole tensors in production order, each at most cap_elems elements unless it is a
    single tensor larger than that; together they cover the flat gradient region exactly. A bucket
    is issued at the point of its last tensor, so its all-reduce runs while the backward goes on."""
    if cap_elems < 1:
        raise ValueError(f"bucket cap {cap_elems} must be >= 1 element")
    ext = tensor_extents(table)
    buckets, cur, cur_n, cur_point = [], [], 0, None

    def close():
        buckets.append(Bucket(len(buckets), cur_point, tuple(cur), _merge(ext[n] for n in cur)))

    for point, names in production_order(table):
        for name in names:
            a, b = ext[name]
            if cur and cur_n + (b - a) > cap_elems:
                close()
                cur, cur_n = [], 0
            cur.append(name)
            cur_n += b - a
            cur_point = point
    if cur:
        close()
    return buckets


# ---------------------------------------------------------------------------------------------
# ZeRO-1 shards

@dataclass(frozen=True)
class ZeroShards:
    """Rank r owns [r*shard, (r+1)*shard) of the flat region; the last rank also owns the tail
    [world*shard, total) (fewer than ALIGN*world elements), which it gets by ncclReduce and hands
    back by ncclBroadcast. shard is a multiple of ALIGN, so every owned range starts 16-byte aligned
    and the reduce-scatter / all-gather of [0, world*shard) are in place."""
    total: int
    world: int
    shard: int

    @property
    def even(self) -> int:
        return self.shard * self.world

    @property
    def tail(self) -> int:
        return self.total - self.even

    def owned(self, rank: int) -> tuple:
        if not 0 <= rank < self.world:
            raise ValueError(f"rank {rank} outside 0..{self.world - 1}")
        start = rank * self.shard
        return start, (self.total if rank == self.world - 1 else start + self.shard)


def zero_shards(total: int, world: int, align: int = ALIGN) -> ZeroShards:
    if world < 1 or total < 0 or align < 1:
        raise ValueError(f"zero_shards({total}, {world}, {align})")
    return ZeroShards(int(total), int(world), int(total) // (world * align) * align)
