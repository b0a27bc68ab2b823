"""torch_kernels.ood.extract_features against transformers' own ``output_hidden_states``, computed
one text at a time with no padding: a causal LM (tiny random Llama) and an encoder (tiny random
BERT), every layer index, both poolings, batches with padding; the on-disk cache; bad arguments."""

from __future__ import annotations

import pytest
import torch

from torch_kernels.ood import extract_features

transformers = pytest.importorskip("transformers")  # a test dependency ([test] extra)


def _llama(num_layers=3):
    config = transformers.LlamaConfig(vocab_size=97, hidden_size=32, intermediate_size=48,
                                      num_hidden_layers=num_layers, num_attention_heads=2, num_key_value_heads=1,
                                      bos_token_id=None, eos_token_id=None, pad_token_id=None)
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config).eval()


def _bert():
    config = transformers.BertConfig(vocab_size=97, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                     num_attention_heads=2, max_position_embeddings=64, pad_token_id=0)
    torch.manual_seed(0)
    return transformers.BertModel(config, add_pooling_layer=False).eval()


def _word_tokenizer(words):
    """A real transformers fast tokenizer over a small word vocabulary, built offline."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"[PAD]": 0, "[UNK]": 1, **{w: i + 2 for i, w in enumerate(words)}}
    inner = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    inner.pre_tokenizer = pre_tokenizers.Whitespace()
    return transformers.PreTrainedTokenizerFast(tokenizer_object=inner, pad_token="[PAD]", unk_token="[UNK]")


def _texts(lengths, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(2, 97, (n,), generator=gen).tolist() for n in lengths]


@torch.no_grad()
def _direct(model, texts, layer, pooling):
    """One unpadded forward per text, through transformers' output_hidden_states."""
    rows = []
    for ids in texts:
        hidden = model.base_model(torch.tensor([ids]), output_hidden_states=True).hidden_states[layer][0]
        rows.append(hidden.mean(0) if pooling == "mean" else hidden[-1])
    return torch.stack(rows)


@pytest.mark.parametrize("pooling", ["mean", "last"])
@pytest.mark.parametrize("make_model", [_llama, _bert], ids=["llama", "bert"])
def test_every_layer_matches_output_hidden_states(make_model, pooling):
    model = make_model()
    num_layers = model.config.num_hidden_layers
    texts = _texts([3, 17, 1, 9, 12, 5, 30])  # batches of 3 mix lengths, so padding is exercised
    for layer in [*range(num_layers + 1), -1, -num_layers - 1]:
        got = extract_features(model, None, texts, layer=layer, pooling=pooling, batch_size=3, progress=False)
        want = _direct(model, texts, layer, pooling)
        assert got.dtype == torch.float32 and got.shape == (len(texts), 32)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5, msg=lambda m: f"layer {layer}: {m}")


@pytest.mark.parametrize("pooling", ["mean", "last"])
def test_spans_and_several_layers_match_output_hidden_states(pooling):
    """skip_first / skip_last leave positions out; a list of layers comes from one forward pass."""
    model = _llama()
    texts = _texts([4, 17, 5, 9, 12])
    ran = []
    for i, layer in enumerate(model.model.layers):
        layer.register_forward_hook(lambda *_, i=i: ran.append(i))
    got = extract_features(model, None, texts, layer=[2, 0, -1], pooling=pooling, batch_size=2, progress=False,
                           skip_first=1, skip_last=2)
    assert got.shape == (len(texts), 3, 32) and len(ran) == 3 * 3  # 3 batches, each through the 3 layers once
    with torch.no_grad():
        for i, ids in enumerate(texts):
            states = model.base_model(torch.tensor([ids]), output_hidden_states=True).hidden_states
            for k, layer in enumerate([2, 0, 3]):
                kept = states[layer][0, 1:len(ids) - 2]
                want = kept.mean(0) if pooling == "mean" else kept[-1]
                torch.testing.assert_close(got[i, k], want, rtol=1e-5, atol=1e-5)
    ran.clear()
    extract_features(model, None, texts, layer=[1, 0], progress=False)
    assert ran == [0]  # no layer past the last one wanted


def test_a_shared_prefix_the_pooling_skips_runs_once():
    """A chat template's prefix: its keys and values are computed once and reused for every text."""
    model = _llama()
    template = [5, 6, 7, 8]
    texts = [template + t for t in _texts([2, 6, 3, 9, 2])]
    widths = []
    model.model.embed_tokens.register_forward_hook(lambda m, args, out: widths.append(args[0].shape))
    got = extract_features(model, None, texts, layer=[1, -1], batch_size=2, progress=False, skip_first=4, skip_last=1)
    assert widths[0] == (1, 4) and all(w[1] <= 9 for w in widths[1:])  # the prefix once, then only the rest
    with torch.no_grad():
        for i, ids in enumerate(texts):
            states = model.base_model(torch.tensor([ids]), output_hidden_states=True).hidden_states
            for k, layer in enumerate([1, 3]):
                torch.testing.assert_close(got[i, k], states[layer][0, 4:len(ids) - 1].mean(0), rtol=1e-5, atol=1e-5)


def test_an_early_layer_runs_no_later_layer():
    model = _llama(num_layers=3)
    ran = []
    for i, layer in enumerate(model.model.layers):
        layer.register_forward_hook(lambda *_, i=i: ran.append(i))
    extract_features(model, None, _texts([4, 6]), layer=1, progress=False)
    assert ran == [0]
    ran.clear()
    extract_features(model, None, _texts([4, 6]), layer=-1, progress=False)
    assert ran == [0, 1, 2]


def test_strings_go_through_the_tokenizer():
    model = _bert()
    tokenizer = _word_tokenizer(["book", "a", "flight", "to", "paris", "what", "is", "my", "balance"])
    texts = ["book a flight to paris", "what is my balance", "paris"]
    ids = [tokenizer(t)["input_ids"] for t in texts]
    assert ids[0] == [2, 3, 4, 5, 6]
    mixed = [texts[0], ids[1], torch.tensor(ids[2])]  # strings, id lists and id tensors mix
    for layer in (1, -1):
        got = extract_features(model, tokenizer, mixed, layer=layer, batch_size=2, progress=False)
        torch.testing.assert_close(got, _direct(model, ids, layer, "mean"), rtol=1e-5, atol=1e-5)


def test_features_can_feed_a_training_fit():
    """Not inference tensors: a scorer trained by gradient descent can take them as inputs."""
    features = extract_features(_llama(), None, _texts([3, 5]), progress=False)
    head = torch.nn.Linear(32, 1)
    head(features).square().sum().backward()
    assert head.weight.grad is not None


def test_cache_reads_back_and_keys_on_content(tmp_path, monkeypatch):
    model, texts = _llama(), _texts([3, 8, 5])
    first = extract_features(model, None, texts, layer=2, cache_dir=tmp_path, progress=False)
    assert len(list(tmp_path.glob("features-*.pt"))) == 1

    def no_forward(*args, **kwargs):
        raise AssertionError("the cache was not used")

    with monkeypatch.context() as patch:
        patch.setattr(model.model, "forward", no_forward)
        again = extract_features(model, None, texts, layer=-2, cache_dir=tmp_path, progress=False)  # -2 is 2
    assert torch.equal(again, first)

    # any change of content is a new entry: layer, pooling, texts, weights
    extract_features(model, None, texts, layer=1, cache_dir=tmp_path, progress=False)
    extract_features(model, None, texts, layer=2, pooling="last", cache_dir=tmp_path, progress=False)
    extract_features(model, None, texts[:2], layer=2, cache_dir=tmp_path, progress=False)
    with torch.no_grad():
        model.model.layers[1].mlp.down_proj.weight.mul_(2)
    changed = extract_features(model, None, texts, layer=2, cache_dir=tmp_path, progress=False)
    assert len(list(tmp_path.glob("features-*.pt"))) == 5
    assert not torch.allclose(changed, first)


@pytest.mark.parametrize("kwargs, error, match", [
    (dict(layer=4), ValueError, r"^layer: expected an index in \[-4, 3\] .*got 4"),
    (dict(layer=-5), ValueError, r"^layer: expected an index in \[-4, 3\]"),
    (dict(layer=1.0), TypeError, r"^layer: expected an int, got float"),
    (dict(pooling="max"), ValueError, r"^pooling: expected one of \('mean', 'last'\), got 'max'"),
    (dict(batch_size=0), ValueError, r"^batch_size: expected an int >= 1, got 0"),
    (dict(batch_size=2.0), TypeError, r"^batch_size: expected an int"),
    (dict(texts="one text"), TypeError, r"^texts: expected a list of strings or of token-id lists, got str"),
    (dict(texts=[]), ValueError, r"^texts: expected at least one text"),
    (dict(texts=[[1, 2], []]), ValueError, r"^texts\[1\]: expected at least one token"),
    (dict(texts=[[1, 2], [1.5]]), TypeError, r"^texts\[1\]: expected a string or a sequence of int token ids"),
    (dict(texts=[torch.tensor([1.0])]), TypeError, r"^texts\[0\]: expected a 1-D integer tensor"),
    (dict(texts=["needs a tokenizer"]), TypeError, r"^tokenizer: expected a tokenizer to encode texts\[0\]"),
    (dict(cache_dir=3), TypeError, r"^cache_dir: expected a path or None"),
    (dict(layer=[]), ValueError, r"^layer: expected an int or a non-empty sequence"),
    (dict(skip_first=-1), ValueError, r"^skip_first: expected an int >= 0"),
    (dict(skip_last=True), TypeError, r"^skip_last: expected an int, got bool"),
    (dict(skip_first=2, skip_last=1), ValueError, r"^texts\[0\]: expected more than skip_first \+ skip_last = 3"),
    (dict(model=torch.nn.Linear(2, 2)), TypeError, r"^model: expected a transformers model"),
])
def test_bad_arguments_name_them(kwargs, error, match):
    args = dict(model=_llama(), tokenizer=None, texts=[[1, 2, 3]], progress=False) | kwargs
    with pytest.raises(error, match=match):
        extract_features(**args)
