"""The fixed workload of the vLLM tests and benchmark: prompts of different lengths, some longer
than a prefill chunk, and a long shared prefix that a second round finds in the prefix cache."""

from __future__ import annotations

# About 300 tokens: longer than a prefill chunk (MAX_BATCHED_TOKENS) and several KV blocks, so a
# second round reuses whole cached blocks of it.
SHARED_PREFIX = (
    "The following is a short history of lighthouses, written for a museum guide. "
    "The earliest lighthouses were fires lit on hilltops to guide ships into harbour at night. "
    "The Pharos of Alexandria, finished around 280 BC, stood more than a hundred metres tall and "
    "was counted among the wonders of the ancient world; its keepers burned wood, and some "
    "accounts say that a great mirror of polished bronze threw the light far out to sea. The "
    "Romans built towers along the coasts of their empire, from Dover to the Black Sea, and some "
    "of them stand to this day. In the middle ages, monks and merchant guilds kept lights on "
    "dangerous headlands, often paid for by tolls on passing ships. The great change came in the "
    "eighteenth and nineteenth centuries: the Argand lamp with its hollow wick burned far more "
    "brightly than candles, parabolic reflectors gathered its light into a beam, and in 1822 "
    "Augustin Fresnel designed a lens of concentric glass rings that bent almost all of the lamp's "
    "light into a narrow horizontal beam visible more than thirty kilometres away. Rotating "
    "lenses gave each lighthouse its own pattern of flashes, so that a sailor could tell one "
    "coast from another in the dark. Keepers lived in the towers with their families, trimming "
    "wicks, winding the clockwork that turned the lens, and keeping the glass spotless. Electric "
    "lamps arrived at the end of the nineteenth century, and during the twentieth century most "
    "lights were automated, so that today very few lighthouses have keepers at all. "
)

PROMPTS = [
    "The capital of France is",
    "Write a haiku about the sea.",
    "1, 2, 3, 4, 5,",
    "Explain in two sentences why the sky is blue during the day and red at sunset.",
    SHARED_PREFIX + "Question: who designed the lens of concentric glass rings? Answer:",
    SHARED_PREFIX + "Question: what did the keepers of a lighthouse do? Answer:",
    "A recipe for pancakes needs flour, eggs, milk and a pinch of salt. First,",
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
]

MAX_TOKENS = 24
# A small prefill budget per step, so the long prompts are prefilled in several chunks beside
# other sequences' decodes; small blocks, so the shared prefix spans several of them.
MAX_BATCHED_TOKENS = 64
BLOCK_SIZE = 32
# The MLA model: longer answers; blocks of 16, the only size vLLM's reference CPU MLA backend takes
MLA_MAX_TOKENS = 32
MLA_BLOCK_SIZE = 16


def engine_args(dtype: str, **overrides) -> dict:
    """``vllm.LLM`` keyword arguments of the workload: eager, chunked prefill, prefix caching,
    everything in this process (no engine or worker subprocesses)."""
    args = dict(dtype=dtype, enforce_eager=True, seed=0, max_model_len=1024, enable_chunked_prefill=True,
                max_num_batched_tokens=MAX_BATCHED_TOKENS, enable_prefix_caching=True, block_size=BLOCK_SIZE,
                distributed_executor_backend="uni")
    args.update(overrides)
    return args
