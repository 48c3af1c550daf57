import json
import os
import struct

import numpy as np
import pytest

from gptcuda.model.checkpoint import (FORMAT_VERSION, CheckpointError, load_checkpoint,
                                      read_checkpoint_meta, save_checkpoint)


def sample():
    r = np.random.default_rng(0)
    arrays = {
        "wte": r.standard_normal((65, 32)).astype(np.float32),
        "h.0.attn.w": r.standard_normal((32, 96)).astype(np.float32),
        "steps": np.array([3, -1, 2**31 - 1], dtype=np.int32),
        "bytes": np.arange(13, dtype=np.uint8),
        "scalar": np.array(2.5, dtype=np.float64),
        "empty": np.zeros((0, 4), dtype=np.float32),
        "nan": np.array([np.nan, -0.0, np.inf], dtype=np.float32),
    }
    meta = {"iter": 1234, "best_val_loss": 1.4697, "config": {"n_layer": 2, "out_dir": "out/ü"},
            "tokenizer": ["a", "b", "\n"]}
    return arrays, meta


def save(tmp_path, name="ckpt.bin"):
    arrays, meta = sample()
    p = tmp_path / name
    save_checkpoint(p, arrays, meta)
    return p, arrays, meta


def test_round_trip(tmp_path):
    p, arrays, meta = save(tmp_path)
    got, got_meta = load_checkpoint(p)
    assert got_meta == meta
    assert list(got) == list(arrays)
    for k, a in arrays.items():
        b = got[k]
        assert b.dtype == a.dtype and b.shape == a.shape
        assert a.tobytes() == b.tobytes()  # bit-exact, NaN and -0.0 included
        assert b.flags.writeable and b.flags.c_contiguous
    got["wte"][0, 0] = 7.0  # writable, independent copies


def test_noncontiguous_input(tmp_path):
    a = np.arange(24, dtype=np.float32).reshape(4, 6)[:, ::2].T
    save_checkpoint(tmp_path / "c", {"a": a}, {})
    got, _ = load_checkpoint(tmp_path / "c")
    assert np.array_equal(got["a"], a)


def test_offsets_aligned(tmp_path):
    p, _, _ = save(tmp_path)
    raw = p.read_bytes()
    assert raw[:8] == b"GPTCUDA\0"
    (hlen,) = struct.unpack("<Q", raw[8:16])
    header = json.loads(raw[16:16 + hlen])
    assert header["version"] == FORMAT_VERSION == 1
    assert all(e["offset"] % 64 == 0 for e in header["arrays"])


def test_atomic_no_temp_left(tmp_path):
    p, _, _ = save(tmp_path)
    save_checkpoint(p, {"x": np.ones(3, np.float32)}, {"iter": 2})  # overwrite in place
    assert os.listdir(tmp_path) == ["ckpt.bin"]
    assert load_checkpoint(p)[1] == {"iter": 2}


def test_failed_save_keeps_old_file(tmp_path):
    p, _, meta = save(tmp_path)
    with pytest.raises(CheckpointError):
        save_checkpoint(p, {"x": np.ones(3)}, {"bad": object()})
    with pytest.raises(CheckpointError):
        save_checkpoint(p, {"x": np.array([object()])}, {})
    assert os.listdir(tmp_path) == ["ckpt.bin"]
    assert load_checkpoint(p)[1] == meta


def test_read_meta_only(tmp_path):
    p, _, meta = save(tmp_path)
    assert read_checkpoint_meta(p) == meta


def one_line(e):
    assert "\n" not in str(e.value)
    return str(e.value)


def test_missing_file(tmp_path):
    with pytest.raises(CheckpointError) as e:
        load_checkpoint(tmp_path / "nope.bin")
    assert "nope.bin" in one_line(e)


@pytest.mark.parametrize("where", ["data", "last", "header_meta"])
def test_corrupted_byte_detected(tmp_path, where):
    p, _, _ = save(tmp_path)
    raw = bytearray(p.read_bytes())
    (hlen,) = struct.unpack("<Q", raw[8:16])
    if where == "data":
        i = len(raw) - 200
    elif where == "last":
        i = len(raw) - 1
    else:
        i = raw.index(b"1234")  # the iteration number inside the JSON header
    raw[i] ^= 0x01
    p.write_bytes(bytes(raw))
    with pytest.raises(CheckpointError) as e:
        load_checkpoint(p)
    assert "corrupt" in one_line(e)


@pytest.mark.parametrize("keep", [4, 12, 100, -1, -64])
def test_truncated_file_detected(tmp_path, keep):
    p, _, _ = save(tmp_path)
    raw = p.read_bytes()
    p.write_bytes(raw[:keep] if keep > 0 else raw[:len(raw) + keep])
    with pytest.raises(CheckpointError) as e:
        load_checkpoint(p)
    assert "corrupt" in one_line(e)


def test_trailing_garbage_detected(tmp_path):
    p, _, _ = save(tmp_path)
    p.write_bytes(p.read_bytes() + b"x")
    with pytest.raises(CheckpointError) as e:
        load_checkpoint(p)
    assert "corrupt" in one_line(e)


def test_wrong_version(tmp_path):
    p, _, _ = save(tmp_path)
    raw = p.read_bytes()
    (hlen,) = struct.unpack("<Q", raw[8:16])
    header = raw[16:16 + hlen].replace(b'"version":1', b'"version":7')
    assert len(header) == hlen
    p.write_bytes(raw[:16] + header + raw[16 + hlen:])
    with pytest.raises(CheckpointError) as e:
        load_checkpoint(p)
    assert "format version 7, this build reads 1" in one_line(e)


@pytest.mark.parametrize("content", [b"", b"PK\x03\x04 not a checkpoint at all", b"\x80\x02}q\x00."])
def test_wrong_magic(tmp_path, content):
    p = tmp_path / "model.pt"
    p.write_bytes(content)
    with pytest.raises(CheckpointError) as e:
        load_checkpoint(p)
    assert "not a gptcuda checkpoint" in one_line(e)


def test_expected_shapes_ok(tmp_path):
    p, arrays, _ = save(tmp_path)
    got, _ = load_checkpoint(p, {k: a.shape for k, a in arrays.items()})
    assert set(got) == set(arrays)


def test_expected_shape_mismatch_names_tensor(tmp_path):
    p, arrays, _ = save(tmp_path)
    expected = {k: a.shape for k, a in arrays.items()}
    expected["h.0.attn.w"] = (32, 192)
    with pytest.raises(CheckpointError) as e:
        load_checkpoint(p, expected)
    s = one_line(e)
    assert "h.0.attn.w" in s and "(32, 96)" in s and "(32, 192)" in s
    assert "from another model shape" in s


def test_expected_missing_and_extra(tmp_path):
    p, arrays, _ = save(tmp_path)
    expected = {k: a.shape for k, a in arrays.items()}
    expected["lm_head"] = (65, 32)
    with pytest.raises(CheckpointError) as e:
        load_checkpoint(p, expected)
    assert "lm_head" in one_line(e) and "another model shape" in str(e.value)
    expected = {k: a.shape for k, a in arrays.items() if k != "bytes"}
    with pytest.raises(CheckpointError) as e:
        load_checkpoint(p, expected)
    assert "'bytes'" in one_line(e) and "another model shape" in str(e.value)
