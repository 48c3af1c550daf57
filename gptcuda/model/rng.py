"""Counter-based random numbers shared bit for bit by the CUDA kernels and the numpy reference.

Nothing random is stored: a dropout mask or a batch offset is a pure function of
(seed, step, site, element index), so the backward pass recomputes the mask, a
resumed run draws the same batches, and the reference backend reproduces the GPU's
choices exactly. The same arithmetic lives in kernels/common.cuh (`gc_hash32`,
`gc_key`, `gc_keep_word`, `gc_keep_att`); tests/test_rng.py pins known values so the two cannot drift.
"""
import numpy as np

M32 = 0xFFFFFFFF
GOLDEN = 0x9E3779B9

# Site ids: every random consumer has its own stream. Dropout sites are per layer:
# DROPOUT_BASE + 4*layer + {0: attention probabilities, 1: attention residual, 2: mlp residual};
# the embedding dropout is site DROPOUT_EMB.
SITE_BATCH_TRAIN = 1
SITE_BATCH_VAL = 2
SITE_BATCH_EVAL_TRAIN = 3
SITE_SAMPLE = 7          # generation: key(seed, draw number, SITE_SAMPLE), element = 2 * sequence (+1)
DROPOUT_EMB = 15
DROPOUT_BASE = 16


def dropout_site(layer: int, which: int) -> int:
    """which: 0 attention probabilities, 1 attention-output residual, 2 mlp-output residual."""
    return DROPOUT_BASE + 4 * layer + which


def micro_site(site: int, micro: int) -> int:
    """A dropout site in micro-batch `micro` of a step (gradient accumulation): micro-batch 0 keeps
    the site, so a run without accumulation draws what it always drew."""
    return site + (micro << 16)


def hash32(x):
    """A 32-bit integer mixer (xorshift-multiply, 'lowbias32'). Works on ints and uint32 arrays."""
    x = np.asarray(x, dtype=np.uint64) & M32
    x ^= x >> 16
    x = (x * 0x7FEB352D) & M32
    x ^= x >> 15
    x = (x * 0x846CA68B) & M32
    x ^= x >> 16
    return x


def key(seed: int, step: int, site: int) -> int:
    """The 32-bit key of one random stream: key = H(H(H(seed) ^ site) + step * GOLDEN)."""
    k = hash32(hash32(seed & M32) ^ (site & M32))
    return int(hash32((int(k) + (step & M32) * GOLDEN) & M32))


def uniform_u32(k: int, idx):
    """The random word of element idx (uint32 array) in stream k: H(idx ^ k) then once more with k."""
    idx = np.asarray(idx, dtype=np.uint64) & M32
    return hash32((hash32(idx ^ k) + k) & M32)


def keep_word(k: int, pairs):
    """The keep word of pair index `pairs` (uint32 array) in stream k: one round, H(pair ^ k) (the key
    is already three rounds of seed, site and step; kernels/common.cuh: gc_keep_word)."""
    pairs = np.asarray(pairs, dtype=np.uint64) & M32
    return hash32(pairs ^ np.uint64(k & M32))


def keep_threshold(p: float) -> int:
    """An element is kept when its 16-bit half of a keep word is >= threshold; p is the drop probability
    (kept with probability 1 - threshold / 2^16, within 2^-16 of 1 - p)."""
    return min(int(p * 65536.0), 0xFFFF)


def dropout_mask(seed: int, step: int, site: int, n: int, p: float, cols: int | None = None) -> np.ndarray:
    """Boolean keep-mask of n elements (row-major), taken as rows of `cols` elements (default: one row).

    The two elements of a pair, columns 2c and 2c + 1 of row r, share the keep word (keep_word) of the pair
    index r * ceil(cols / 2) + c (mod 2^32): the even column is kept when the word's low 16 bits are >= the
    threshold, the odd column on its high 16 bits. One word serves two elements, so a kernel that holds
    both draws one word for them (kernels/common.cuh: gc_keep_word, gc_keep_half, gc_dropout1).
    The embedding's and the residuals' masks are flat; attention probabilities take attention_keep.
    """
    cols = n if cols is None else int(cols)
    if n == 0:
        return np.zeros(0, dtype=bool)
    if cols <= 0 or n % cols:
        raise ValueError(f"dropout_mask: {n} elements are not rows of {cols}")
    rows, half = n // cols, (cols + 1) // 2
    pairs = (np.arange(rows, dtype=np.uint64)[:, None] * np.uint64(half)
             + np.arange(half, dtype=np.uint64)[None, :]) & np.uint64(M32)
    w = keep_word(key(seed, step, site), pairs)
    halves = np.stack([w & np.uint64(0xFFFF), w >> np.uint64(16)], axis=-1).reshape(rows, 2 * half)[:, :cols]
    return (halves >= np.uint64(keep_threshold(p))).reshape(n)


def attention_threshold(p: float) -> int:
    """A probability of the attention is kept when its byte of a keep word is >= this (attention_keep)."""
    return min(int(p * 256.0), 0xFF)


def attention_rate(p: float) -> float:
    """The drop rate the attention's masks draw for dropout p: attention_threshold(p) / 256 (within 2^-8
    of p; 0.2 -> 0.19921875); the kept probabilities are scaled by 1 / (1 - attention_rate(p))."""
    return attention_threshold(p) / 256.0


def attention_words(T: int) -> int:
    """Keep words a row of T keys takes in an attention mask: one for every four keys, 16-key blocks."""
    return 4 * ((int(T) + 15) // 16)


def attention_keep(seed: int, step: int, site: int, shape, p: float) -> np.ndarray:
    """Boolean keep-mask of attention probabilities [..., T, T] (rows: queries, flattened with the leading
    axes: row R = (b * H + h) * T + i; columns: keys j).

    Keys 2c, 2c + 1, 2c + 8 and 2c + 9 of a block of 16 (c = 0 .. 3) share one keep word (keep_word), that of
    the quad index R * attention_words(T) + (j // 16) * 4 + c (mod 2^32); key j takes byte
    2 * ((j >> 3) & 1) + (j & 1) of it and is kept when that byte is >= attention_threshold(p). A thread of
    the tensor-core kernels holds keys 2c, 2c + 1 of 8-key groups j and j + 1 of a query (forward, dQ), or
    keys g and g + 8 of it (dK / dV), so it draws one word for four (two) probabilities
    (kernels/common.cuh: gc_keep_att)."""
    shape = tuple(int(d) for d in shape)
    T, rows = shape[-1], int(np.prod(shape[:-1]))
    j = np.arange(T, dtype=np.uint64)[None, :]
    quads = (np.arange(rows, dtype=np.uint64)[:, None] * np.uint64(attention_words(T))
             + (j >> np.uint64(4)) * np.uint64(4) + ((j >> np.uint64(1)) & np.uint64(3))) & np.uint64(M32)
    byte = ((j >> np.uint64(2)) & np.uint64(2)) | (j & np.uint64(1))
    w = keep_word(key(seed, step, site), quads)
    return (((w >> (np.uint64(8) * byte)) & np.uint64(0xFF)) >= np.uint64(attention_threshold(p))).reshape(shape)


def dropout_keep(seed: int, step: int, site: int, shape, p: float, rows: bool = False) -> np.ndarray:
    """The keep-mask of a dropout in `shape`: rows=True, attention probabilities [B, H, T, T]
    (attention_keep), rows=False the tensor flat (dropout_mask: embedding and residual dropout)."""
    shape = tuple(int(d) for d in shape)
    if rows:
        return attention_keep(seed, step, site, shape, p)
    return dropout_mask(seed, step, site, int(np.prod(shape)), p).reshape(shape)


def batch_offsets(seed: int, counter: int, site: int, batch: int, n_tokens: int, block: int) -> np.ndarray:
    """Start offsets of a batch of `batch` windows of block+1 tokens in a split of n_tokens tokens."""
    span = n_tokens - block  # valid starts: 0 .. n_tokens-block-1 (y needs one token more)
    k = key(seed, counter, site)
    w = uniform_u32(k, np.arange(batch, dtype=np.uint64))
    if span > 2**32:  # a split of over 4G tokens: a second word (element 2**31 + row) for the high bits
        w = (uniform_u32(k, np.arange(batch, dtype=np.uint64) | np.uint64(2**31)) << np.uint64(32)) | w
    return (w % np.uint64(span)).astype(np.int64)
