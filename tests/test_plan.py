"""The one bucketing policy of jaxkv.kv.plan: never less than asked, few shapes."""

from jaxkv.kv import plan


def test_chunk_lengths_pad_to_sixteens_then_to_128s():
  assert [plan.chunk_len(n) for n in (1, 16, 17, 37, 44, 100, 128, 129, 300)] == \
      [16, 16, 32, 48, 48, 112, 128, 256, 384]
  assert len({plan.chunk_len(n) for n in range(1, 1025)}) == 8 + 7   # 16..128, 256..1024


def test_bucket_never_gives_less_and_respects_the_cap():
  for n in range(1, 3000, 7):
    for lo, fine, step in ((16, 128, 16), (128, 512, None), (1, 16, None)):
      b = plan.bucket(n, lo, fine, step=step)
      assert b >= max(n, lo)
      assert plan.bucket(b, lo, fine, step=step) == b          # buckets are fixed points
  assert plan.bucket(3, 1, 16, hi=16) == 4 and plan.bucket(40, 1, 16, hi=16) == 40
  assert [plan.width(n) for n in (1, 129, 300, 600)] == [128, 256, 512, 1024]
