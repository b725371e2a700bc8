"""jaxkv.models.gguf_file against gguf-py's own reader and writer."""

import gguf
import numpy as np
import pytest

from jaxkv.models import gguf_file, presets, weights


def _write(path, tensors=()):
  w = gguf.GGUFWriter(str(path), "llama")
  w.add_uint8("t.u8", 7)
  w.add_int8("t.i8", -7)
  w.add_uint16("t.u16", 65535)
  w.add_int16("t.i16", -300)
  w.add_uint32("t.u32", 2**32 - 1)
  w.add_int32("t.i32", -(2**31))
  w.add_float32("t.f32", 0.1)
  w.add_bool("t.bool", True)
  w.add_string("t.str", "héllo ▁world")
  w.add_uint64("t.u64", 2**64 - 1)
  w.add_int64("t.i64", -(2**63))
  w.add_float64("t.f64", 1e-300)
  w.add_array("t.strs", ["a", "", "ü b"])
  w.add_array("t.ints", [1, -2, 3])
  w.add_array("t.floats", [0.5, -1.25])
  w.add_array("t.nested", [[1, 2], [3]])
  for name, arr, qtype in tensors:
    w.add_tensor(name, arr, raw_dtype=qtype)
  w.write_header_to_file()
  w.write_kv_data_to_file()
  w.write_tensors_to_file()
  w.close()


def test_metadata_and_tensors_round_trip_gguf_writer(tmp_path):
  rng = np.random.default_rng()
  f32 = rng.normal(size=(3, 8)).astype(np.float32)
  f16 = rng.normal(size=(4, 6)).astype(np.float16)
  q8_src = rng.normal(size=(2, 64)).astype(np.float32)
  q8 = gguf.quants.quantize(q8_src, gguf.GGMLQuantizationType.Q8_0)
  path = tmp_path / "t.gguf"
  _write(path, [("a", f32, None), ("b", f16, None),
                ("c", q8, gguf.GGMLQuantizationType.Q8_0)])
  f = gguf_file.read(path)
  m = f.metadata
  assert (m["t.u8"], m["t.i8"], m["t.u16"], m["t.i16"]) == (7, -7, 65535, -300)
  assert (m["t.u32"], m["t.i32"], m["t.u64"], m["t.i64"]) == (2**32 - 1, -(2**31), 2**64 - 1,
                                                              -(2**63))
  assert m["t.f32"] == np.float32(0.1) and m["t.f64"] == 1e-300 and m["t.bool"] is True
  assert m["t.str"] == "héllo ▁world" and m["t.strs"] == ["a", "", "ü b"]
  assert m["t.ints"] == [1, -2, 3] and m["t.floats"] == [0.5, -1.25]
  assert m["t.nested"] == [[1, 2], [3]]
  assert m["general.architecture"] == "llama"
  assert f.tensors["a"].shape == (3, 8) and np.array_equal(f.tensors["a"].dequantize(), f32)
  np.testing.assert_array_equal(f.tensors["b"].dequantize(), f16.astype(np.float32))
  assert f.tensors["c"].shape == (2, 64)
  np.testing.assert_array_equal(f.tensors["c"].dequantize(),
                                gguf.quants.dequantize(q8, gguf.GGMLQuantizationType.Q8_0))
  np.testing.assert_allclose(f.tensors["c"].dequantize(), q8_src, atol=0.03)


def test_equals_gguf_reader_on_the_shipped_smollm2_file():
  path = presets.smollm2_gguf()
  ours, ref = gguf_file.read(path), gguf.GGUFReader(path)
  keys = {k for k in ref.fields if not k.startswith("GGUF.")}
  assert keys == set(ours.metadata)
  for k in keys:
    assert ref.fields[k].contents() == pytest.approx(ours.metadata[k]), k
  assert [t.name for t in ref.tensors] == list(ours.tensors)
  for t in ref.tensors:
    o = ours.tensors[t.name]
    assert o.shape == tuple(int(d) for d in reversed(t.shape))
    assert o.ggml_type == int(t.tensor_type)
    assert np.array_equal(np.asarray(o.data), np.asarray(t.data).view(np.uint8).reshape(-1))


def test_bad_files_are_clear_errors(tmp_path):
  bad = tmp_path / "x.gguf"
  bad.write_bytes(b"GGML" + bytes(40))
  with pytest.raises(ValueError, match="not a GGUF file"):
    gguf_file.read(bad)
  with pytest.raises(FileNotFoundError):
    gguf_file.read(tmp_path / "missing.gguf")
  src = presets.smollm2_gguf().read_bytes()
  for cut in (64, 2_000_000):   # inside the metadata; inside the tensor data
    part = tmp_path / f"cut{cut}.gguf"
    part.write_bytes(src[:cut])
    with pytest.raises(ValueError, match=r"truncated|past the end"):
      weights.load_gguf(part)
  bad.write_bytes(b"GGUF" + (9).to_bytes(4, "little") + bytes(40))
  with pytest.raises(ValueError, match="version 9"):
    gguf_file.read(bad)
