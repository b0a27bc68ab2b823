"""Every bad-input table (``tests/bad_inputs.py``) on every backend, and every message pinned.

Each (family, backend) table runs in a process of its own with a time limit, so a kernel that
crashes or hangs fails its test rather than taking the run down. Every row must raise its error
type with a message starting with its argument's name, and every backend must give the same
messages as the reference. The reference's messages are pinned in full below with expecttest: a
reworded message fails here until it is reviewed and accepted (``EXPECTTEST_ACCEPT=1 pytest
tests/test_bad_inputs.py`` rewrites the pinned text).
"""

from __future__ import annotations

import functools
import json
import os
import pathlib
import subprocess
import sys

import expecttest
import pytest

import bad_inputs
from harness import require_backend
from torch_kernels import backends

TESTS = pathlib.Path(__file__).resolve().parent
TIME_LIMIT_S = 300


def _in_subprocess(family: str, backend: str) -> list[list[str]]:
    path = os.pathsep.join([str(TESTS.parent), str(TESTS), os.environ.get("PYTHONPATH", "")])
    try:
        done = subprocess.run([sys.executable, str(TESTS / "bad_inputs.py"), family, backend], capture_output=True,
                              text=True, cwd=TESTS.parent, env={**os.environ, "PYTHONPATH": path},
                              timeout=TIME_LIMIT_S)
    except subprocess.TimeoutExpired:
        pytest.fail(f"{family} table on {backend}: hung for over {TIME_LIMIT_S} s")
    assert done.returncode == 0, f"{family} table on {backend} crashed (exit {done.returncode}):\n{done.stderr[-4000:]}"
    return json.loads(done.stdout.strip().splitlines()[-1])


@functools.cache
def _reference_text(family: str) -> str:
    return _format(bad_inputs.run(family, "reference"))


def _format(results) -> str:
    return "\n".join(f"{case} -> {error}: {message}" for case, error, message in results) + "\n"


@pytest.mark.parametrize("backend", backends.BACKENDS)
@pytest.mark.parametrize("family", bad_inputs.FAMILIES)
def test_table_on_backend(family, backend):
    require_backend(backend)
    results = _in_subprocess(family, backend)
    rows = bad_inputs.table(family)
    assert [case for case, _, _ in results] == [row.case for row in rows]
    wrong = [f"{row.case}: expected {row.error.__name__} naming {row.argument!r}, got {error}: {message}"
             for row, (_, error, message) in zip(rows, results)
             if error != row.error.__name__ or not message.startswith(f"{row.argument}:")]
    assert not wrong, "\n".join(wrong)
    assert _format(results) == _reference_text(family), f"{backend}'s messages differ from the reference's"


class PinnedMessages(expecttest.TestCase):
    def test_paged_attention(self):
        self.assertExpectedInline(_reference_text("paged_attention"), """\
ragged_paged_attention: q_len above kv_len -> ValueError: kv_lens: expected each sequence's kv length to count its new query tokens too, got kv length 1 at index 0 below its query length 2
ragged_paged_attention: negative kv_len -> ValueError: kv_lens: expected lengths >= 0, got -1 at index 1
ragged_paged_attention: kv_len past block_table -> ValueError: kv_lens: expected at most 48 tokens (block_table's 3 pages of 16), got 49 at index 2
ragged_paged_attention: block id past the cache -> ValueError: block_table: expected block ids in [0, 6) for the pages a sequence uses, got 6 for sequence 2
ragged_paged_attention: negative block id -> ValueError: block_table: expected block ids in [0, 6) for the pages a sequence uses, got -1 for sequence 0
ragged_paged_attention: cu_q_lens decreasing -> ValueError: cu_q_lens: expected non-decreasing offsets, got a decrease at 2 at index 1
ragged_paged_attention: cu_q_lens not from 0 -> ValueError: cu_q_lens: expected to start at 0, got 1
ragged_paged_attention: cu_q_lens not to T -> ValueError: cu_q_lens: expected to end at the number of query tokens 5, got 4
ragged_paged_attention: cu_q_lens size -> ValueError: cu_q_lens: expected size 4 in dimension 0 (sequences S of kv_lens, plus one), got 3
ragged_paged_attention: block_table rows -> ValueError: block_table: expected size 3 in dimension 0 (sequences S of kv_lens), got 2
ragged_paged_attention: block_table 1-D -> ValueError: block_table: expected 2 dimensions, got shape (3,)
ragged_paged_attention: slot past the cache -> ValueError: slot_mapping: expected -1 (padding) or a slot in [0, 96) (num_blocks * block_size), got 96 at index 0
ragged_paged_attention: slot below -1 -> ValueError: slot_mapping: expected -1 (padding) or a slot in [0, 96) (num_blocks * block_size), got -2 at index 4
ragged_paged_attention: slot twice -> ValueError: slot_mapping: expected each slot at most once, got slot 52 twice
ragged_paged_attention: slot_mapping size -> ValueError: slot_mapping: expected size 5 in dimension 0 (tokens), got 4
ragged_paged_attention: cu_q_lens int64 -> TypeError: cu_q_lens: expected dtype in (int32), got torch.int64
ragged_paged_attention: kv_lens int64 -> TypeError: kv_lens: expected dtype in (int32), got torch.int64
ragged_paged_attention: block_table int64 -> TypeError: block_table: expected dtype in (int32), got torch.int64
ragged_paged_attention: slot_mapping int16 -> TypeError: slot_mapping: expected dtype in (int64, int32), got torch.int16
ragged_paged_attention: slot_mapping float -> TypeError: slot_mapping: expected dtype in (int64, int32), got torch.float32
ragged_paged_attention: query int -> TypeError: query: expected dtype in (float16, bfloat16, float32), got torch.int32
ragged_paged_attention: query float64 -> TypeError: query: expected dtype in (float16, bfloat16, float32), got torch.float64
ragged_paged_attention: query 2-D -> ValueError: query: expected 3 dimensions, got shape (5, 64)
ragged_paged_attention: query not a tensor -> TypeError: query: expected a torch.Tensor, got ndarray
ragged_paged_attention: heads not a multiple -> ValueError: query: expected a number of heads divisible by key_cache's 2 kv heads, got 3
ragged_paged_attention: head size -> ValueError: key_cache: expected size 32 in dimension 3 (head size D of query), got 64
ragged_paged_attention: caches in another float dtype -> TypeError: key_cache: expected dtype in (float32, int8, float8_e4m3fn, float8_e5m2), got torch.float16
ragged_paged_attention: caches float64 -> TypeError: key_cache: expected dtype in (float32, int8, float8_e4m3fn, float8_e5m2), got torch.float64
ragged_paged_attention: caches uint8 -> TypeError: key_cache: expected dtype in (float32, int8, float8_e4m3fn, float8_e5m2), got torch.uint8
ragged_paged_attention: value_cache dtype -> TypeError: value_cache: expected dtype torch.float32 (as key_cache), got torch.int8
ragged_paged_attention: value_cache shape -> ValueError: value_cache: expected shape (6, 16, 2, 64) (as key_cache), got (5, 16, 2, 64)
ragged_paged_attention: key_cache 3-D -> ValueError: key_cache: expected 4 dimensions, got shape (16, 2, 64)
ragged_paged_attention: key_cache last dimension strided -> ValueError: key_cache: expected a stride-1 last dimension and no two entries sharing memory (it is written in place), got strides (4096, 256, 128, 2) for shape (6, 16, 2, 64)
ragged_paged_attention: value_cache last dimension strided -> ValueError: value_cache: expected a stride-1 last dimension and no two entries sharing memory (it is written in place), got strides (4096, 256, 128, 2) for shape (6, 16, 2, 64)
ragged_paged_attention: key_cache blocks sharing memory -> ValueError: key_cache: expected a stride-1 last dimension and no two entries sharing memory (it is written in place), got strides (0, 128, 64, 1) for shape (6, 16, 2, 64)
ragged_paged_attention: no cache blocks -> ValueError: key_cache: expected no empty dimension, got shape (0, 16, 2, 64)
ragged_paged_attention: key dtype -> TypeError: key: expected dtype in (float32), got torch.float16
ragged_paged_attention: value dtype -> TypeError: value: expected dtype in (float32), got torch.float16
ragged_paged_attention: key shape -> ValueError: key: expected shape (5, 2, 64) (tokens, key_cache's kv heads and head size), got (5, 1, 64)
ragged_paged_attention: value shape -> ValueError: value: expected shape (5, 2, 64) (tokens, key_cache's kv heads and head size), got (4, 2, 64)
ragged_paged_attention: key without value -> ValueError: key, value, slot_mapping: expected all three (to write new tokens first) or none, got key=given, value=None, slot_mapping=given
ragged_paged_attention: key without slot_mapping -> ValueError: key, value, slot_mapping: expected all three (to write new tokens first) or none, got key=given, value=given, slot_mapping=None
ragged_paged_attention: kv_lens on meta -> ValueError: kv_lens: expected device cpu (as query), got meta
ragged_paged_attention: k_scale on meta -> ValueError: k_scale: expected device cpu (as query), got meta
ragged_paged_attention: slot_mapping on meta -> ValueError: slot_mapping: expected device cpu (as query), got meta
ragged_paged_attention: sliding_window 0 -> ValueError: sliding_window: expected None or an int >= 1, got 0
ragged_paged_attention: sliding_window negative -> ValueError: sliding_window: expected None or an int >= 1, got -4
ragged_paged_attention: sliding_window 2.5 -> TypeError: sliding_window: expected None or an int, got float 2.5
ragged_paged_attention: sliding_window True -> TypeError: sliding_window: expected None or an int, got bool True
ragged_paged_attention: soft_cap 0 -> ValueError: soft_cap: expected None or a finite number > 0 (float32: at most 3.403e+38), got 0.0
ragged_paged_attention: soft_cap negative -> ValueError: soft_cap: expected None or a finite number > 0 (float32: at most 3.403e+38), got -30.0
ragged_paged_attention: soft_cap inf -> ValueError: soft_cap: expected None or a finite number > 0 (float32: at most 3.403e+38), got inf
ragged_paged_attention: soft_cap nan -> ValueError: soft_cap: expected None or a finite number > 0 (float32: at most 3.403e+38), got nan
ragged_paged_attention: soft_cap past float32 -> ValueError: soft_cap: expected None or a finite number > 0 (float32: at most 3.403e+38), got 1e+39
ragged_paged_attention: soft_cap True -> TypeError: soft_cap: expected None or a float, got bool True
ragged_paged_attention: sm_scale inf -> ValueError: sm_scale: expected a finite number > 0 (float32: at most 3.403e+38), got inf
ragged_paged_attention: sm_scale nan -> ValueError: sm_scale: expected a finite number > 0 (float32: at most 3.403e+38), got nan
ragged_paged_attention: sm_scale 0 -> ValueError: sm_scale: expected a finite number > 0 (float32: at most 3.403e+38), got 0.0
ragged_paged_attention: sm_scale negative -> ValueError: sm_scale: expected a finite number > 0 (float32: at most 3.403e+38), got -0.125
ragged_paged_attention: sm_scale past float32 -> ValueError: sm_scale: expected a finite number > 0 (float32: at most 3.403e+38), got 1e+39
ragged_paged_attention: sm_scale a string -> TypeError: sm_scale: expected a float, got str '0.25'
ragged_paged_attention: sm_scale None -> TypeError: sm_scale: expected a float, got NoneType None
ragged_paged_attention: sm_scale a tensor -> TypeError: sm_scale: expected a float, got Tensor tensor(0.1250)
ragged_paged_attention: k_scale per wrong heads -> ValueError: k_scale: expected one float32 scale or one per kv head ([2]), got shape (3,)
ragged_paged_attention: k_scale 2-D -> ValueError: k_scale: expected one float32 scale or one per kv head ([2]), got shape (1, 1)
ragged_paged_attention: k_scale [Hkv, 1] -> ValueError: k_scale: expected one float32 scale or one per kv head ([2]), got shape (2, 1)
ragged_paged_attention: v_scale per wrong heads -> ValueError: v_scale: expected one float32 scale or one per kv head ([2]), got shape (4,)
ragged_paged_attention: k_scale float64 -> TypeError: k_scale: expected dtype in (float32), got torch.float64
ragged_paged_attention: v_scale float16 -> TypeError: v_scale: expected dtype in (float32), got torch.float16
ragged_paged_attention: k_scale 0 -> ValueError: k_scale: expected finite scales > 0 (a cache entry means entry * scale), got 0.0
ragged_paged_attention: k_scale negative -> ValueError: k_scale: expected finite scales > 0 (a cache entry means entry * scale), got -0.5
ragged_paged_attention: v_scale nan -> ValueError: v_scale: expected finite scales > 0 (a cache entry means entry * scale), got nan
ragged_paged_attention: v_scale inf -> ValueError: v_scale: expected finite scales > 0 (a cache entry means entry * scale), got inf
reshape_and_cache: key 2-D -> ValueError: key: expected 3 dimensions, got shape (2, 64)
reshape_and_cache: key int -> TypeError: key: expected dtype in (float16, bfloat16, float32), got torch.int32
reshape_and_cache: key not a tensor -> TypeError: key: expected a torch.Tensor, got list
reshape_and_cache: value dtype -> TypeError: value: expected dtype in (float32), got torch.bfloat16
reshape_and_cache: value shape -> ValueError: value: expected shape (5, 2, 64) (tokens, key_cache's kv heads and head size), got (5, 2, 32)
reshape_and_cache: key heads -> ValueError: key: expected shape (5, 2, 64) (tokens, key_cache's kv heads and head size), got (5, 4, 64)
reshape_and_cache: cache dtype -> TypeError: key_cache: expected dtype in (float32, int8, float8_e4m3fn, float8_e5m2), got torch.float16
reshape_and_cache: value_cache dtype -> TypeError: value_cache: expected dtype torch.float32 (as key_cache), got torch.float8_e4m3fn
reshape_and_cache: value_cache last dimension strided -> ValueError: value_cache: expected a stride-1 last dimension and no two entries sharing memory (it is written in place), got strides (4096, 256, 128, 2) for shape (6, 16, 2, 64)
reshape_and_cache: value_cache blocks sharing memory -> ValueError: value_cache: expected a stride-1 last dimension and no two entries sharing memory (it is written in place), got strides (0, 128, 64, 1) for shape (6, 16, 2, 64)
reshape_and_cache: slot_mapping int16 -> TypeError: slot_mapping: expected dtype in (int64, int32), got torch.int16
reshape_and_cache: slot_mapping size -> ValueError: slot_mapping: expected size 5 in dimension 0 (tokens), got 4
reshape_and_cache: slot past the cache -> ValueError: slot_mapping: expected -1 (padding) or a slot in [0, 96) (num_blocks * block_size), got 1099511627776 at index 2
reshape_and_cache: slot twice -> ValueError: slot_mapping: expected each slot at most once, got slot 19 twice
reshape_and_cache: k_scale shape -> ValueError: k_scale: expected one float32 scale or one per kv head ([2]), got shape (5,)
reshape_and_cache: v_scale dtype -> TypeError: v_scale: expected dtype in (float32), got torch.bfloat16
reshape_and_cache: k_scale 0 -> ValueError: k_scale: expected finite scales > 0 (a cache entry means entry * scale), got 0.0
reshape_and_cache: v_scale nan -> ValueError: v_scale: expected finite scales > 0 (a cache entry means entry * scale), got nan
reshape_and_cache: v_scale negative inf -> ValueError: v_scale: expected finite scales > 0 (a cache entry means entry * scale), got -inf
reshape_and_cache: slot_mapping on meta -> ValueError: slot_mapping: expected device cpu (as key), got meta
reshape_and_cache: key_cache on meta -> ValueError: key_cache: expected device cpu (as key), got meta
""")

    def test_linear_attention(self):
        self.assertExpectedInline(_reference_text("linear_attention"), """\
chunk_gated_delta_rule: k shape -> ValueError: k: expected shape (1, 6, 2, 8) (as q), got (1, 6, 2, 4)
fused_recurrent_gated_delta_rule: k shape -> ValueError: k: expected shape (1, 6, 2, 8) (as q), got (1, 6, 2, 4)
chunk_simple_gla: k shape -> ValueError: k: expected shape (1, 6, 2, 8) (as q), got (1, 6, 2, 4)
chunk_gated_delta_rule: v time -> ValueError: v: expected size 6 in dimension 1 (time T of q), got 5
fused_recurrent_gated_delta_rule: v time -> ValueError: v: expected size 6 in dimension 1 (time T of q), got 5
chunk_simple_gla: v time -> ValueError: v: expected size 6 in dimension 1 (time T of q), got 5
chunk_gated_delta_rule: v heads not a multiple -> ValueError: v: expected a number of value heads divisible by q's 2 heads, got 3
fused_recurrent_gated_delta_rule: v heads not a multiple -> ValueError: v: expected a number of value heads divisible by q's 2 heads, got 3
chunk_simple_gla: gla v heads -> ValueError: v: expected size 2 in dimension 2 (heads H of q), got 4
chunk_gated_delta_rule: v dtype -> TypeError: v: expected dtype in (float32), got torch.float16
fused_recurrent_gated_delta_rule: v dtype -> TypeError: v: expected dtype in (float32), got torch.float16
chunk_simple_gla: v dtype -> TypeError: v: expected dtype in (float32), got torch.float16
chunk_gated_delta_rule: q int -> TypeError: q: expected dtype in (float16, bfloat16, float32, float64), got torch.int32
fused_recurrent_gated_delta_rule: q int -> TypeError: q: expected dtype in (float16, bfloat16, float32, float64), got torch.int32
chunk_simple_gla: q int -> TypeError: q: expected dtype in (float16, bfloat16, float32, float64), got torch.int32
chunk_gated_delta_rule: q 3-D -> ValueError: q: expected 4 dimensions, got shape (6, 2, 8)
fused_recurrent_gated_delta_rule: q 3-D -> ValueError: q: expected 4 dimensions, got shape (6, 2, 8)
chunk_simple_gla: q 3-D -> ValueError: q: expected 4 dimensions, got shape (6, 2, 8)
chunk_gated_delta_rule: q not a tensor -> TypeError: q: expected a torch.Tensor, got list
fused_recurrent_gated_delta_rule: q not a tensor -> TypeError: q: expected a torch.Tensor, got list
chunk_simple_gla: q not a tensor -> TypeError: q: expected a torch.Tensor, got list
chunk_gated_delta_rule: K = 0 -> ValueError: q: expected a key head size K >= 1, got shape (1, 6, 2, 0)
fused_recurrent_gated_delta_rule: K = 0 -> ValueError: q: expected a key head size K >= 1, got shape (1, 6, 2, 0)
chunk_simple_gla: K = 0 -> ValueError: q: expected a key head size K >= 1, got shape (1, 6, 2, 0)
chunk_gated_delta_rule: V = 0 -> ValueError: q, v: expected non-empty head dimensions, got q (1, 6, 2, 8) and v (1, 6, 4, 0)
fused_recurrent_gated_delta_rule: V = 0 -> ValueError: q, v: expected non-empty head dimensions, got q (1, 6, 2, 8) and v (1, 6, 4, 0)
chunk_simple_gla: V = 0 -> ValueError: q, v: expected non-empty head dimensions, got q (1, 6, 2, 8) and v (1, 6, 2, 0)
chunk_gated_delta_rule: g shape -> ValueError: g: expected shape (1, 6, 4) (B, T and value heads of v), got (1, 6, 1)
fused_recurrent_gated_delta_rule: g shape -> ValueError: g: expected shape (1, 6, 4) (B, T and value heads of v), got (1, 6, 1)
chunk_simple_gla: g shape -> ValueError: g: expected shape (1, 6, 2) (B, T and value heads of v), got (1, 6, 1)
chunk_gated_delta_rule: g int -> TypeError: g: expected dtype in (float16, bfloat16, float32, float64), got torch.int32
fused_recurrent_gated_delta_rule: g int -> TypeError: g: expected dtype in (float16, bfloat16, float32, float64), got torch.int32
chunk_simple_gla: g int -> TypeError: g: expected dtype in (float16, bfloat16, float32, float64), got torch.int32
chunk_gated_delta_rule: g positive -> ValueError: g: expected log decays <= 0 (exp(g) scales the state down), got 0.5 at index (0, 3, 1)
fused_recurrent_gated_delta_rule: g positive -> ValueError: g: expected log decays <= 0 (exp(g) scales the state down), got 0.5 at index (0, 3, 1)
chunk_simple_gla: g positive -> ValueError: g: expected log decays <= 0 (exp(g) scales the state down), got 0.5 at index (0, 3, 1)
chunk_gated_delta_rule: beta missing -> TypeError: beta: expected a torch.Tensor (the update strength), got NoneType
fused_recurrent_gated_delta_rule: beta missing -> TypeError: beta: expected a torch.Tensor (the update strength), got NoneType
chunk_gated_delta_rule: g missing -> TypeError: g: expected a torch.Tensor (the log decay; zeros for none), got NoneType
fused_recurrent_gated_delta_rule: g missing -> TypeError: g: expected a torch.Tensor (the log decay; zeros for none), got NoneType
chunk_gated_delta_rule: initial_state shape -> ValueError: initial_state: expected shape (1, 4, 8, 8) (sequences, value heads, K, V), got (1, 4, 8, 4)
fused_recurrent_gated_delta_rule: initial_state shape -> ValueError: initial_state: expected shape (1, 4, 8, 8) (sequences, value heads, K, V), got (1, 4, 8, 4)
chunk_simple_gla: initial_state shape -> ValueError: initial_state: expected shape (1, 2, 8, 8) (sequences, value heads, K, V), got (1, 2, 8, 4)
chunk_gated_delta_rule: initial_state int -> TypeError: initial_state: expected dtype in (float16, bfloat16, float32, float64), got torch.int32
fused_recurrent_gated_delta_rule: initial_state int -> TypeError: initial_state: expected dtype in (float16, bfloat16, float32, float64), got torch.int32
chunk_simple_gla: initial_state int -> TypeError: initial_state: expected dtype in (float16, bfloat16, float32, float64), got torch.int32
chunk_gated_delta_rule: cu_seqlens with batch 2 -> ValueError: cu_seqlens: packed sequences need batch size 1, got q of shape (2, 6, 2, 8)
fused_recurrent_gated_delta_rule: cu_seqlens with batch 2 -> ValueError: cu_seqlens: packed sequences need batch size 1, got q of shape (2, 6, 2, 8)
chunk_simple_gla: cu_seqlens with batch 2 -> ValueError: cu_seqlens: packed sequences need batch size 1, got q of shape (2, 6, 2, 8)
chunk_gated_delta_rule: cu_seqlens not to T -> ValueError: cu_seqlens: expected to end at the time length T=6, got 5
fused_recurrent_gated_delta_rule: cu_seqlens not to T -> ValueError: cu_seqlens: expected to end at the time length T=6, got 5
chunk_simple_gla: cu_seqlens not to T -> ValueError: cu_seqlens: expected to end at the time length T=6, got 5
chunk_gated_delta_rule: cu_seqlens not from 0 -> ValueError: cu_seqlens: expected to start at 0, got 1
fused_recurrent_gated_delta_rule: cu_seqlens not from 0 -> ValueError: cu_seqlens: expected to start at 0, got 1
chunk_simple_gla: cu_seqlens not from 0 -> ValueError: cu_seqlens: expected to start at 0, got 1
chunk_gated_delta_rule: cu_seqlens decreasing -> ValueError: cu_seqlens: expected non-decreasing offsets, got [0, 4, 2, 6]
fused_recurrent_gated_delta_rule: cu_seqlens decreasing -> ValueError: cu_seqlens: expected non-decreasing offsets, got [0, 4, 2, 6]
chunk_simple_gla: cu_seqlens decreasing -> ValueError: cu_seqlens: expected non-decreasing offsets, got [0, 4, 2, 6]
chunk_gated_delta_rule: cu_seqlens float -> TypeError: cu_seqlens: expected dtype in (int32, int64), got torch.float32
fused_recurrent_gated_delta_rule: cu_seqlens float -> TypeError: cu_seqlens: expected dtype in (int32, int64), got torch.float32
chunk_simple_gla: cu_seqlens float -> TypeError: cu_seqlens: expected dtype in (int32, int64), got torch.float32
chunk_gated_delta_rule: cu_seqlens one offset -> ValueError: cu_seqlens: expected at least two offsets [0, T], got shape (1,)
fused_recurrent_gated_delta_rule: cu_seqlens one offset -> ValueError: cu_seqlens: expected at least two offsets [0, T], got shape (1,)
chunk_simple_gla: cu_seqlens one offset -> ValueError: cu_seqlens: expected at least two offsets [0, T], got shape (1,)
chunk_gated_delta_rule: scale nan -> ValueError: scale: expected a finite number, got nan
fused_recurrent_gated_delta_rule: scale nan -> ValueError: scale: expected a finite number, got nan
chunk_simple_gla: scale nan -> ValueError: scale: expected a finite number, got nan
chunk_gated_delta_rule: scale a string -> TypeError: scale: expected None or a float, got str '0.5'
fused_recurrent_gated_delta_rule: scale a string -> TypeError: scale: expected None or a float, got str '0.5'
chunk_simple_gla: scale a string -> TypeError: scale: expected None or a float, got str '0.5'
chunk_gated_delta_rule: scale True -> TypeError: scale: expected None or a float, got bool True
fused_recurrent_gated_delta_rule: scale True -> TypeError: scale: expected None or a float, got bool True
chunk_simple_gla: scale True -> TypeError: scale: expected None or a float, got bool True
chunk_gated_delta_rule: k on meta -> ValueError: k: expected device cpu (as q), got meta
fused_recurrent_gated_delta_rule: k on meta -> ValueError: k: expected device cpu (as q), got meta
chunk_simple_gla: k on meta -> ValueError: k: expected device cpu (as q), got meta
""")

    def test_ood(self):
        self.assertExpectedInline(_reference_text("ood"), """\
x 1-D -> ValueError: x: expected 2 dimensions, got shape (4,)
means 1-D -> ValueError: means: expected 2 dimensions, got shape (4,)
means features -> ValueError: means: expected size 4 in dimension 1 (features D of x), got 3
whitener rows -> ValueError: whitener: expected size 4 in dimension 0 (features D of x), got 3
whitener columns -> ValueError: whitener: expected size 4 in dimension 1 (features D of x), got 3
x int -> TypeError: x: expected dtype in (float16, bfloat16, float32, float64), got torch.int32
means float64 for float16 x -> TypeError: means: expected dtype in (float16, float32), got torch.float64
whitener float16 for float32 x -> TypeError: whitener: expected dtype in (float32), got torch.float16
means on meta -> ValueError: means: expected device cpu (as x), got meta
x not a tensor -> TypeError: x: expected a torch.Tensor, got ndarray
no classes -> ValueError: means: expected at least one class, got shape (0, D)
no features -> ValueError: x: expected at least one feature, got shape (B, 0)
covariance unknown -> ValueError: covariance: expected one of ('empirical', 'ledoit_wolf', 'oas'), got 'shrunk'
ridge negative -> ValueError: ridge: expected a finite float >= 0, got -1.0
ridge nan -> ValueError: ridge: expected a finite float >= 0, got nan
fit singular -> ValueError: features: the covariance is singular (fewer samples than features, or constant or collinear features); pass ridge > 0 or use covariance='ledoit_wolf' or 'oas'
fit NaN -> ValueError: features: batch 0 contains NaN or inf
fit inf in batch 1 -> ValueError: features: batch 1 contains NaN or inf
fit int features -> TypeError: features: expected dtype in (float16, bfloat16, float32, float64), got torch.int64
fit 1-D features -> ValueError: features: expected 2 dimensions, got shape (5,)
fit nothing -> ValueError: features: expected at least one row, got none
fit batches of other widths -> ValueError: features: batch 1 has 3 features, the first had 4
labels none -> ValueError: labels: expected at least one label, got none
labels count -> ValueError: labels: batch 0 has 50 rows but its labels do not match
labels missing class -> ValueError: labels: classes [1] have no samples (class ids must be 0..C-1, all present)
labels id 2**40 -> ValueError: labels: expected class ids 0..C-1 with every class present, got id 1099511627776 among only 50 labels
labels negative -> ValueError: labels: expected class ids >= 0, got -1 in batch 0
labels float -> TypeError: labels: expected dtype in (int64, int32, int16, uint8), got torch.float32
labels with a one-shot iterator -> ValueError: features: a one-shot iterator cannot be read twice; with labels and covariance='oas' pass a tensor or a list of batches
threshold tpr 1.5 -> ValueError: tpr: expected a fraction in (0, 1], got 1.5
threshold tpr 0 -> ValueError: tpr: expected a fraction in (0, 1], got 0.0
threshold tpr True -> TypeError: tpr: expected a float fraction in (0, 1], got bool True
threshold tpr a string -> TypeError: tpr: expected a float fraction in (0, 1], got str '0.95'
threshold NaN features -> ValueError: features: NaN or inf features give scores no threshold can be taken from
threshold no rows -> ValueError: features: expected at least one row, got none
score before fit -> RuntimeError: MahalanobisScorer: call fit() (or load_state_dict()) before scoring
""")

    def test_serving(self):
        self.assertExpectedInline(_reference_text("serving"), """\
block_size 0 -> ValueError: block_size: expected an int >= 1, got 0
block_size negative -> ValueError: block_size: expected an int >= 1, got -16
block_size 2.5 -> TypeError: block_size: expected an int, got float 2.5
num_blocks 0 -> ValueError: num_blocks: expected an int >= 1, got 0
max_seqs True -> TypeError: max_seqs: expected an int, got bool True
max_batched_tokens 0 -> ValueError: max_batched_tokens: expected an int >= 1, got 0
max_new_tokens 2.5 -> TypeError: max_new_tokens: expected an int, got float 2.5
max_new_tokens 0 -> ValueError: max_new_tokens: expected an int >= 1, got 0
max_new_tokens per prompt -> ValueError: max_new_tokens: expected one limit per prompt (2), got 1
prompts a string -> TypeError: prompts: expected a list of prompts (each a list of token ids), got str
a prompt a string -> TypeError: prompts[0]: expected a sequence of token ids (ints; encode text with the tokenizer first), got str
token id past the vocabulary -> ValueError: prompts[0]: expected token ids in [0, 97) (the model's vocabulary), got 97 at index 1
negative token id -> ValueError: prompts[1]: expected token ids in [0, 97) (the model's vocabulary), got -3 at index 0
float token id -> TypeError: prompts[0]: expected int token ids, got float 2.0 at index 1
empty prompt -> ValueError: prompts[0]: expected at least one token, got none
float tensor prompt -> TypeError: prompts[0]: expected a 1-D integer tensor of token ids, got torch.float32 of shape (1,)
more blocks than the cache -> ValueError: prompts[0]: 30 tokens plus max_new_tokens=8 need 10 blocks, the cache has 8 of 4 tokens
""")

    def test_moe(self):
        self.assertExpectedInline(_reference_text("moe"), """\
router_topk: logits int -> TypeError: logits: expected dtype in (float16, bfloat16, float32, float64), got torch.int32
router_topk: logits 1-D -> ValueError: logits: expected 2 dimensions, got shape (4,)
router_topk: top_k 0 -> ValueError: top_k: expected 1 <= top_k <= 4 (experts in logits), got 0
router_topk: top_k past the experts -> ValueError: top_k: expected 1 <= top_k <= 4 (experts in logits), got 5
router_topk: top_k 2.5 -> TypeError: top_k: expected an int, got float 2.5
router_topk: scoring unknown -> ValueError: scoring: expected one of ('softmax', 'sigmoid'), got 'relu'
router_topk: renormalize a string -> TypeError: renormalize: expected a bool, got str
router_topk: groups without topk_groups -> ValueError: num_expert_groups, topk_groups: expected both or neither, got 2 and None
router_topk: groups not dividing the experts -> ValueError: num_expert_groups: expected a divisor of the 4 experts, got 3
router_topk: topk_groups past the groups -> ValueError: topk_groups: expected 1 <= topk_groups <= num_expert_groups (2), got 3
router_topk: top_k past the kept groups -> ValueError: top_k: expected at most the 1 experts of the topk_groups kept groups, got 2
router_topk: correction_bias size -> ValueError: correction_bias: expected size 4 in dimension 0 (experts E of logits), got 3
router_topk: routed_scaling_factor nan -> ValueError: routed_scaling_factor: expected a finite number, got nan
moe_dispatch: x int -> TypeError: x: expected dtype in (float16, bfloat16, float32, float64), got torch.int32
moe_dispatch: topk_ids float -> TypeError: topk_ids: expected dtype in (int32, int64), got torch.float32
moe_dispatch: expert id past the experts -> ValueError: topk_ids: expected expert ids in [0, 4) or -1 (dropped), got 4 at (1, 1)
moe_dispatch: expert id below -1 -> ValueError: topk_ids: expected expert ids in [0, 4) or -1 (dropped), got -2 at (0, 0)
moe_dispatch: topk_ids rows -> ValueError: topk_ids: expected size 5 in dimension 0 (tokens T of x), got 4
moe_dispatch: num_experts 0 -> ValueError: num_experts: expected an int >= 1, got 0
moe_combine: handle a tuple -> TypeError: handle: expected the MoEHandle that moe_dispatch returned, got tuple
moe_combine: y rows -> ValueError: y: expected size 10 in dimension 0 (rows T * k of the dispatch), got 9
moe_combine: topk_weights shape -> ValueError: topk_weights: expected shape (5, 2) (T, k of the dispatch), got (5, 1)
grouped_mm: x 1-D -> ValueError: x: expected 2 dimensions, got shape (16,)
grouped_mm: w dtype -> TypeError: w: expected dtype in (float32), got torch.float16
grouped_mm: w K -> ValueError: w: expected size 16 in dimension 1 (K of x), got 8
grouped_mm: offsets int64 -> TypeError: offsets: expected dtype in (int32), got torch.int64
grouped_mm: offsets per expert -> ValueError: offsets: expected size 4 in dimension 0 (experts E of w), got 3
grouped_mm: offsets decreasing -> ValueError: offsets: expected non-decreasing cumulative row ends, got 1 after 2
grouped_mm: offsets past the rows -> ValueError: offsets: expected to end at most at the 10 rows of x, got 11
grouped_mm: out_dtype int -> TypeError: out_dtype: expected None or a float dtype, got torch.int32
grouped_mm: no experts for the rows -> ValueError: w: expected at least one expert for the 10 rows of x (offsets assign rows to experts), got shape (0, 16, 8)
fused_moe: x hidden size -> ValueError: w13: expected size 15 in dimension 2 (hidden size H of x), got 16
fused_moe: w13 odd 2I -> ValueError: w13: expected an even, non-zero size 2I in dimension 1 (gate and up), got 15
fused_moe: w2 shape -> ValueError: w2: expected shape (4, 16, 8) (E, H, I of w13), got (4, 16, 4)
fused_moe: w2 dtype -> TypeError: w2: expected dtype in (float32), got torch.float16
fused_moe: activation unknown -> ValueError: activation: expected one of ('silu', 'gelu', 'swigluoai'), got 'relu'
fused_moe: expert id past the experts -> ValueError: topk_ids: expected expert ids in [0, 4) or -1 (dropped), got 7 at (4, 0)
fused_moe: topk_weights shape -> ValueError: topk_weights: expected shape (5, 2) (as topk_ids), got (5, 1)
fused_moe: fp8 without scales -> ValueError: w13_scale, w2_scale: expected float32 scales for float8_e4m3fn weights, got None
fused_moe: fp8 scale shape -> ValueError: w2_scale: expected shape (4, 16) (per output channel), got (4, 8)
fused_moe: fp8 block scales of another block -> ValueError: w13_scale: expected shape (4, 2, 2) (per [8, 8] block), got (4, 16)
fused_moe: block_shape of three -> ValueError: block_shape: expected [block_n, block_k] of positive ints, got [8, 8, 8]
fused_moe: scales for unquantized weights -> ValueError: w13_scale, w2_scale, block_shape: expected None for unquantized weights (scales go with float8_e4m3fn weights), got weights of torch.float32
fused_moe: fp8 scale float16 -> TypeError: w13_scale: expected dtype in (float32), got torch.float16
""")
