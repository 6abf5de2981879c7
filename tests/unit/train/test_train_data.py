"""slapo_lab.train.data: real files read through HF datasets, a BPE tokenizer trained here, packing, the
seeded order and its layout independence, evaluation batches, synthetic inputs and every user error."""

from __future__ import annotations

import contextlib
import json

import pytest
import torch
from train_fixtures import read_texts, write_corpus, write_tokenizer
from transformers import AutoTokenizer

from slapo_lab.train.data import (
    OBJECTIVES,
    BatchPlan,
    DataError,
    SyntheticData,
    TokenData,
    eval_micro_batches,
    load_data,
    objective_of,
)

N_DOCS = 150
SEQ = 32


def _one_sentence(err, *names) -> str:
    text = str(err.value if hasattr(err, "value") else err)
    assert "\n" not in text and text.endswith("."), text
    assert "Traceback" not in text, text
    for name in names:
        assert str(name) in text, (name, text)
    return text


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """One file of each kind in one directory (plus a file the directory reading must skip)."""
    root = tmp_path_factory.mktemp("corpus")
    files = {
        "jsonl": write_corpus(root, N_DOCS, seed=0, kind="jsonl", name="a"),
        "txt": write_corpus(root, N_DOCS, seed=1, kind="txt", name="b"),
        "parquet": write_corpus(root, N_DOCS, seed=2, kind="parquet", name="c"),
    }
    (root / "README.md").write_text("not training data\n")
    return root, files


@pytest.fixture(scope="module")
def tokenizer_dir(corpus, tmp_path_factory):
    return write_tokenizer(tmp_path_factory.mktemp("tok"), list(corpus[1].values()))


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    return tmp_path_factory.mktemp("hf_datasets_cache")


@pytest.fixture(scope="module")
def data(corpus, tokenizer_dir, cache):
    return TokenData.from_files(corpus[0], tokenizer_dir, SEQ, objective="causal_lm", seed=3, cache_dir=cache)


@pytest.fixture(scope="module")
def mlm_data(corpus, tokenizer_dir, cache):
    return TokenData.from_files(corpus[0], tokenizer_dir, SEQ, objective="masked_lm", seed=3, cache_dir=cache)


def _reference_stream(files, tokenizer_dir) -> list[int]:
    """Tokens of the documents of ``files`` in order, each followed by EOS: packing's ground truth."""
    tok = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    stream: list[int] = []
    for doc in read_texts(files):
        stream += tok(doc, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
    return stream


def _check_packed(data: TokenData, stream: list[int], seq_len: int) -> None:
    n = len(stream) // seq_len
    assert data.num_samples == n and data.num_tokens == len(stream)
    got = data.tokens(range(n))
    assert got.dtype == torch.long and got.shape == (n, seq_len)
    assert torch.equal(got, torch.tensor(stream[: n * seq_len]).view(n, seq_len))


# ---------------------------------------------------------------------------------------------------------
# loading and packing


@pytest.mark.parametrize("kind", ["jsonl", "txt", "parquet"])
def test_each_file_kind_loads_and_packs_with_eos_between_documents(kind, corpus, tokenizer_dir, cache):
    f = corpus[1][kind]
    data = TokenData.from_files(f, tokenizer_dir, SEQ, objective="causal_lm", seed=0, cache_dir=cache)
    assert data.files == [str(f)] and data.num_documents == N_DOCS
    stream = _reference_stream([f], tokenizer_dir)
    _check_packed(data, stream, SEQ)
    eos = AutoTokenizer.from_pretrained(str(tokenizer_dir)).eos_token_id
    assert (
        (data.tokens(range(data.num_samples)) == eos).sum()
        == stream[: data.num_samples * SEQ].count(eos)
        > 10
    )
    batch = data.batch([2, 0], epoch=0)
    assert set(batch) == {"input_ids", "labels"}
    assert batch["input_ids"].shape == (2, SEQ) and torch.equal(batch["input_ids"], batch["labels"])
    assert batch["labels"].data_ptr() != batch["input_ids"].data_ptr()
    assert data.describe() == (
        f"data: 1 file, {N_DOCS} documents, {len(stream):,} tokens -> "
        f"{len(stream) // SEQ:,} sequences of {SEQ} tokens (causal_lm)"
    )


def test_directory_reads_its_files_in_sorted_order(data, corpus, tokenizer_dir):
    files = corpus[1]
    assert data.files == [str(files[k]) for k in ("jsonl", "txt", "parquet")]  # a, b, c; README skipped
    assert data.num_documents == 3 * N_DOCS
    _check_packed(data, _reference_stream(files.values(), tokenizer_dir), SEQ)
    assert data.describe().startswith(f"data: 3 files, {3 * N_DOCS} documents, ")


def test_packing_is_exact_across_map_batches_and_drops_only_the_last_partial(corpus, tokenizer_dir, cache):
    f = corpus[1]["jsonl"]  # seq_len 3: thousands of sequences, several packing map batches of 1000
    data = TokenData.from_files(f, tokenizer_dir, 3, objective="causal_lm", seed=0, cache_dir=cache)
    assert data.num_samples > 2000
    _check_packed(data, _reference_stream([f], tokenizer_dir), 3)


def test_blank_documents_are_skipped(tmp_path, tokenizer_dir, cache):
    f = tmp_path / "gaps.txt"
    f.write_text("alpha beta\n\n   \ngamma delta\n")
    data = TokenData.from_files(f, tokenizer_dir, 2, objective="causal_lm", seed=0, cache_dir=cache)
    assert data.num_documents == 2


def test_two_loads_in_fresh_caches_are_identical(corpus, tokenizer_dir, tmp_path, data, mlm_data):
    again = TokenData.from_files(
        corpus[0], tokenizer_dir, SEQ, objective="masked_lm", seed=3, cache_dir=tmp_path / "other_cache"
    )
    idx = list(range(0, again.num_samples, 7))
    assert torch.equal(again.tokens(idx), data.tokens(idx))
    a, b = again.batch(idx, epoch=2), mlm_data.batch(idx, epoch=2)
    assert torch.equal(a["input_ids"], b["input_ids"]) and torch.equal(a["labels"], b["labels"])


def test_main_first_wraps_the_reading(corpus, tokenizer_dir, cache):
    events = []

    @contextlib.contextmanager
    def main_first():
        events.append("enter")
        yield
        events.append("exit")

    data = TokenData.from_files(
        corpus[1]["txt"],
        tokenizer_dir,
        SEQ,
        objective="causal_lm",
        seed=0,
        main_first=main_first(),
        cache_dir=cache,
    )
    assert events == ["enter", "exit"] and data.num_samples > 0


def test_sep_token_separates_documents_when_there_is_no_eos(corpus, tmp_path, cache):
    tok_dir = write_tokenizer(tmp_path / "tok", [corpus[1]["txt"]], eos=False)
    data = TokenData.from_files(
        corpus[1]["txt"], tok_dir, SEQ, objective="causal_lm", seed=0, cache_dir=cache
    )
    sep = AutoTokenizer.from_pretrained(str(tok_dir)).sep_token_id
    assert (data.tokens(range(data.num_samples)) == sep).sum() > 10


def test_objective_of_class_names():
    assert objective_of("LlamaForCausalLM") == objective_of("GPT2LMHeadModel") == "causal_lm"
    assert objective_of("BertForMaskedLM") == "masked_lm"
    assert objective_of("BertModel") is None and objective_of("ViTForImageClassification") is None
    assert OBJECTIVES == ("causal_lm", "masked_lm")


# ---------------------------------------------------------------------------------------------------------
# masked LM


def test_masked_lm_follows_the_collator_rule(mlm_data):
    tok = mlm_data.tokenizer
    idx = list(range(mlm_data.num_samples))
    orig = mlm_data.tokens(idx)
    b = mlm_data.batch(idx, epoch=0)
    ids, labels = b["input_ids"], b["labels"]
    chosen = labels != -100
    special = torch.isin(orig, torch.tensor(tok.all_special_ids))
    assert not (chosen & special).any()  # EOS (special) never masked
    assert torch.equal(labels[chosen], orig[chosen])
    assert torch.equal(ids[~chosen], orig[~chosen])
    frac = chosen.sum().item() / (~special).sum().item()
    assert 0.12 < frac < 0.18, frac
    masked = (ids == tok.mask_token_id) & chosen
    assert 0.74 < masked.sum().item() / chosen.sum().item() < 0.86
    kept = (ids == orig) & chosen
    assert 0.05 < kept.sum().item() / chosen.sum().item() < 0.16


def test_masked_lm_choices_depend_only_on_seed_epoch_and_index(mlm_data, corpus, tokenizer_dir, cache):
    together = mlm_data.batch([5, 9, 1], epoch=1)
    for r, i in enumerate([5, 9, 1]):
        alone = mlm_data.batch([i], epoch=1)
        assert torch.equal(alone["input_ids"][0], together["input_ids"][r])
        assert torch.equal(alone["labels"][0], together["labels"][r])
    assert not torch.equal(mlm_data.batch([5], epoch=2)["labels"], mlm_data.batch([5], epoch=1)["labels"])
    other_seed = TokenData.from_files(
        corpus[0], tokenizer_dir, SEQ, objective="masked_lm", seed=4, cache_dir=cache
    )
    assert not torch.equal(other_seed.batch([5], epoch=1)["labels"], together["labels"][:1])


# ---------------------------------------------------------------------------------------------------------
# order, batches, layouts

G = 8


def _expected_global(data, step, seed):
    spe = data.num_samples // G
    e, within = divmod(step, spe)
    order = torch.randperm(data.num_samples, generator=torch.Generator().manual_seed(seed + e))
    return data.batch(order[within * G : (within + 1) * G].tolist(), e)


@pytest.mark.parametrize("objective", ["causal_lm", "masked_lm"])
def test_replicas_and_micro_batches_reassemble_the_global_batch_on_every_layout(objective, data, mlm_data):
    d = data if objective == "causal_lm" else mlm_data
    spe = d.num_samples // G
    for step in (0, 1, spe - 1, spe, 2 * spe + 3):
        want = _expected_global(d, step, seed=11)
        for dp in (1, 2, 4):
            for micro in (1, 2):
                parts = []
                for rank in range(dp):
                    plan = BatchPlan(d.num_samples, G, micro, dp, rank, seed=11)
                    assert plan.accumulation == G // (micro * dp) and plan.steps_per_epoch == spe
                    mbs = plan.micro_batches(d, step)
                    assert len(mbs) == plan.accumulation
                    assert all(mb["input_ids"].shape == (micro, SEQ) for mb in mbs)
                    parts += mbs
                for key in ("input_ids", "labels"):
                    got = torch.cat([p[key] for p in parts])
                    assert torch.equal(got, want[key]), (objective, step, dp, micro, key)


def test_epochs_visit_each_sample_once_and_skip_the_leftover(data):
    plan = BatchPlan(data.num_samples, G, 2, 2, 0, seed=5)
    spe = data.num_samples // G
    assert plan.epoch(spe - 1) == 0 and plan.epoch(spe) == 1 and plan.epoch(3 * spe + 1) == 3
    seen = [i for s in range(spe) for i in plan.global_indices(s)[0]]
    assert len(seen) == len(set(seen)) == spe * G
    order0 = torch.randperm(data.num_samples, generator=torch.Generator().manual_seed(5)).tolist()
    assert seen == order0[: spe * G]  # the last N mod G positions of epoch 0 are skipped
    idx, e = plan.global_indices(spe)
    order1 = torch.randperm(data.num_samples, generator=torch.Generator().manual_seed(6)).tolist()
    assert e == 1 and idx == order1[:G]


def test_eval_batches_are_in_order_and_split_round_robin(data):
    def real(batch):  # the rows a loss counts (padding rows have every label -100)
        return batch["input_ids"][(batch["labels"] != -100).any(dim=1)]

    m, dp = 2, 2
    per_rank = [list(eval_micro_batches(data, m, dp, r, max_samples=11)) for r in range(dp)]
    assert [len(p) for p in per_rank] == [3, 3]  # 11 samples = 6 micro-batches, the last one padded
    assert all(b["input_ids"].shape == (m, data.seq_len) for p in per_rank for b in p)
    order = [per_rank[k % dp][k // dp] for k in range(6)]
    assert torch.equal(torch.cat([real(b) for b in order]), data.tokens(range(11)))
    assert (order[-1]["labels"][1] == -100).all() and (order[-1]["labels"][0] != -100).all()
    # every sequence is evaluated, once, whatever the number of replicas and the micro-batch size
    for dp, m in ((1, 2), (3, 2), (4, 3), (2, 4)):
        got = [real(b) for r in range(dp) for b in eval_micro_batches(data, m, dp, r, 11)]
        assert sorted(map(tuple, torch.cat(got).tolist())) == sorted(
            map(tuple, data.tokens(range(11)).tolist())
        )
    # a pipeline's groups of micro-batches go to one replica each, the last group padded whole
    per_rank = [list(eval_micro_batches(data, 2, 2, r, max_samples=11, group=2)) for r in range(2)]
    assert [len(p) for p in per_rank] == [4, 2]  # 11 -> 6 micro-batches (the last padded) = 3 groups of 2
    assert torch.equal(torch.cat([b["input_ids"] for b in per_rank[0][:2]]), data.tokens(range(4)))
    assert (per_rank[0][3]["labels"][1] == -100).all() and (per_rank[0][3]["labels"][0] != -100).all()
    last = list(eval_micro_batches(data, 2, 1, 0, max_samples=9, group=2))[-1]  # a micro-batch of padding
    assert len(list(eval_micro_batches(data, 2, 1, 0, max_samples=9, group=2))) == 6
    assert (last["labels"] == -100).all() and last["input_ids"].shape == (2, data.seq_len)
    it = eval_micro_batches(data, 3, 1, 0)
    assert len(it) == -(-data.num_samples // 3)
    next(it)
    assert len(it) == -(-data.num_samples // 3) - 1
    with pytest.raises(DataError) as err:
        eval_micro_batches(data, 4, 1, 0, max_samples=0)
    _one_sentence(err, "--eval-samples")


# ---------------------------------------------------------------------------------------------------------
# synthetic

SPEC = {
    "input_ids": {"shape": [4, 16], "dims": ["batch", "seq"], "dtype": "int64", "low": 0, "high": 100},
    "attention_mask": {"shape": [4, 16], "dims": ["batch", "seq"], "dtype": "int64", "fill": 1},
    "pixel_values": {"shape": [4, 3, 2], "dims": ["batch", 3, 2], "dtype": "float32"},
    "bias_table": {"shape": [5], "dims": [5], "dtype": "float32"},
    "return_dict": {"value": True},
}


def test_synthetic_inputs_follow_the_spec_and_any_layout():
    data = load_data(
        "synthetic", tokenizer_dir=None, seq_len=24, objective=None, seed=1, input_spec=SPEC, lm_labels=True
    )
    assert isinstance(data, SyntheticData) and data.num_samples is None
    b = data.batch([0, 1, 2], epoch=0)
    assert b["input_ids"].shape == (3, 24) and b["input_ids"].dtype == torch.long
    assert 0 <= b["input_ids"].min() and b["input_ids"].max() < 100
    assert torch.equal(b["attention_mask"], torch.ones(3, 24, dtype=torch.long))
    assert b["pixel_values"].shape == (3, 3, 2) and b["pixel_values"].dtype == torch.float32
    assert b["bias_table"].shape == (5,) and torch.equal(b["bias_table"], data.batch([7], 0)["bias_table"])
    assert b["return_dict"] is True and torch.equal(b["labels"], b["input_ids"])
    assert "synthetic" in data.describe()
    plan1 = BatchPlan(None, G, G, 1, 0, seed=1)
    assert plan1.steps_per_epoch is None and plan1.epoch(100) == 0
    for step in (0, 3):
        want = plan1.micro_batches(data, step)[0]
        assert not torch.equal(want["input_ids"], plan1.micro_batches(data, step + 1)[0]["input_ids"])
        for dp, micro in ((2, 1), (4, 2)):
            parts = [
                mb
                for r in range(dp)
                for mb in BatchPlan(None, G, micro, dp, r, seed=1).micro_batches(data, step)
            ]
            for key in ("input_ids", "pixel_values", "labels"):
                assert torch.equal(torch.cat([p[key] for p in parts]), want[key])


# ---------------------------------------------------------------------------------------------------------
# errors: one sentence naming the file


def test_missing_path_and_unsupported_extension(tmp_path, tokenizer_dir, cache):
    missing = tmp_path / "nope.jsonl"
    with pytest.raises(DataError) as err:
        TokenData.from_files(missing, tokenizer_dir, SEQ, objective="causal_lm", seed=0, cache_dir=cache)
    _one_sentence(err, missing)
    csv_file = tmp_path / "data.csv"
    csv_file.write_text("text\nhello\n")
    with pytest.raises(DataError) as err:
        TokenData.from_files(csv_file, tokenizer_dir, SEQ, objective="causal_lm", seed=0, cache_dir=cache)
    _one_sentence(err, csv_file, ".jsonl")
    empty_dir = tmp_path / "d"
    empty_dir.mkdir()
    (empty_dir / "notes.md").write_text("x")
    with pytest.raises(DataError) as err:
        TokenData.from_files(empty_dir, tokenizer_dir, SEQ, objective="causal_lm", seed=0, cache_dir=cache)
    _one_sentence(err, empty_dir)


def test_jsonl_and_parquet_without_text(tmp_path, tokenizer_dir, cache):
    f = tmp_path / "docs.jsonl"
    f.write_text(json.dumps({"body": "hello there"}) + "\n")
    with pytest.raises(DataError) as err:
        TokenData.from_files(f, tokenizer_dir, SEQ, objective="causal_lm", seed=0, cache_dir=cache)
    _one_sentence(err, f, '"text"')
    import pyarrow as pa
    import pyarrow.parquet as pq

    p = tmp_path / "docs.parquet"
    pq.write_table(pa.table({"content": ["a b c"]}), p)
    with pytest.raises(DataError) as err:
        TokenData.from_files(p, tokenizer_dir, SEQ, objective="causal_lm", seed=0, cache_dir=cache)
    _one_sentence(err, p, "content")


def test_unreadable_files_name_the_file(tmp_path, tokenizer_dir, cache):
    bad = tmp_path / "dir"
    bad.mkdir()
    (bad / "a.jsonl").write_text(json.dumps({"text": "fine words here"}) + "\n")
    (bad / "b.jsonl").write_text(json.dumps({"text": "fine"}) + "\n" + '{"text": "broken\n')
    with pytest.raises(DataError) as err:
        TokenData.from_files(bad, tokenizer_dir, SEQ, objective="causal_lm", seed=0, cache_dir=cache)
    _one_sentence(err, bad / "b.jsonl")
    first = tmp_path / "first.jsonl"
    first.write_text("{not json\n")
    with pytest.raises(DataError) as err:
        TokenData.from_files(first, tokenizer_dir, SEQ, objective="causal_lm", seed=0, cache_dir=cache)
    _one_sentence(err, first)
    mixed = tmp_path / "mixed.jsonl"
    mixed.write_text(json.dumps({"text": "words"}) + "\n" + json.dumps({"text": 5}) + "\n")
    with pytest.raises(DataError) as err:
        TokenData.from_files(mixed, tokenizer_dir, SEQ, objective="causal_lm", seed=0, cache_dir=cache)
    _one_sentence(err, mixed)


def test_empty_and_too_short_corpora(tmp_path, tokenizer_dir, cache, data):
    empty = tmp_path / "empty.txt"
    empty.write_text("")
    blank = tmp_path / "blank.txt"
    blank.write_text("\n  \n\n")
    for f in (empty, blank):
        with pytest.raises(DataError) as err:
            TokenData.from_files(f, tokenizer_dir, SEQ, objective="causal_lm", seed=0, cache_dir=cache)
        _one_sentence(err, f)
    short = tmp_path / "short.txt"
    short.write_text("one two\n")
    with pytest.raises(DataError) as err:
        TokenData.from_files(short, tokenizer_dir, 512, objective="causal_lm", seed=0, cache_dir=cache)
    _one_sentence(err, short, "--seq-len")
    with pytest.raises(DataError) as err:
        BatchPlan(data.num_samples, data.num_samples + 1, 1, 1, 0, seed=0, source=data.source)
    _one_sentence(err, data.source, "global batch")


def test_tokenizer_errors_name_the_directory(tmp_path, corpus, cache):
    f = corpus[1]["txt"]
    missing = tmp_path / "no_tokenizer"
    with pytest.raises(DataError) as err:
        TokenData.from_files(f, missing, SEQ, objective="causal_lm", seed=0, cache_dir=cache)
    _one_sentence(err, missing, "--tokenizer")
    with pytest.raises(DataError) as err:
        load_data(str(f), tokenizer_dir=None, seq_len=SEQ, objective="causal_lm", seed=0, cache_dir=cache)
    _one_sentence(err, "--tokenizer")
    bare = write_tokenizer(tmp_path / "bare", [f], eos=False, sep=False, mask=False)
    with pytest.raises(DataError) as err:
        TokenData.from_files(f, bare, SEQ, objective="causal_lm", seed=0, cache_dir=cache)
    _one_sentence(err, bare, "eos")
    with pytest.raises(DataError) as err:
        TokenData.from_files(
            f,
            write_tokenizer(tmp_path / "nomask", [f], mask=False),
            SEQ,
            objective="masked_lm",
            seed=0,
            cache_dir=cache,
        )
    _one_sentence(err, tmp_path / "nomask", "mask")


def test_layout_and_objective_errors(data):
    with pytest.raises(DataError) as err:
        BatchPlan(data.num_samples, 10, 2, 4, 0, seed=0)
    _one_sentence(err, "--global-batch-size", "8")
    with pytest.raises(DataError) as err:
        BatchPlan(data.num_samples, 8, 0, 1, 0, seed=0)
    _one_sentence(err, "--micro-batch-size")
    with pytest.raises(DataError) as err:
        BatchPlan(None, 8, 2, 2, 2, seed=0)
    _one_sentence(err)
    with pytest.raises(DataError) as err:
        load_data(data.source, tokenizer_dir=data.tokenizer_dir, seq_len=SEQ, objective=None, seed=0)
    _one_sentence(err, data.source, "synthetic")
    with pytest.raises(DataError) as err:
        load_data("synthetic", seq_len=SEQ, objective=None, seed=0)
    _one_sentence(err)
    assert issubclass(DataError, ValueError)
