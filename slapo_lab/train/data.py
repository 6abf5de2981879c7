"""The training data of exported scripts: local text files packed into fixed-length token sequences, or
synthetic inputs like the example's, cut into the same global / replica / micro-batches on every layout.

Files (``--data PATH``): a ``.txt`` file (one document per non-blank line), a ``.jsonl`` file (one JSON
object per line with a string ``text`` field), a ``.parquet`` file (a string ``text`` column), or a
directory of such files (its top level only, in sorted order; other files are ignored). They are read
with Hugging Face ``datasets`` (``load_dataset("text" | "json" | "parquet", data_files=...)`` on local
files, cached under the ``datasets`` cache of ``HF_HOME``; never a hub download) and tokenised by the
fast tokenizer of ``--tokenizer DIR`` (``AutoTokenizer.from_pretrained(DIR)``, no special tokens added)
in a batched ``Dataset.map``. Every document is followed by the tokenizer's EOS token (its SEP token if
it has no EOS); the token stream of all documents in order is cut into sequences of ``seq_len`` tokens,
the final partial one dropped (a second batched map, like ``group_texts`` of HF's ``run_clm.py`` but
without dropping tokens at map-batch boundaries). Both maps are cached, so that the other processes of
a run, let in after the first by ``main_first``, read the first one's results.

Objectives (:data:`OBJECTIVES`): ``"causal_lm"`` gives ``{"input_ids": ids, "labels": ids}`` (HF
causal-LM classes shift the labels themselves); ``"masked_lm"`` masks like
``transformers.DataCollatorForLanguageModeling`` (15 % of the non-special tokens are chosen; of those
80 % become the mask token, 10 % a random token, 10 % stay; ``labels`` hold the original ids there and
-100 elsewhere), each sample from its own generator seeded by ``(seed, epoch, sample index)``.

Order and batches (:class:`BatchPlan`): epoch ``e`` visits the ``N`` sequences in
``torch.randperm(N, generator=torch.Generator().manual_seed(seed + e))`` order; optimizer step ``s``
(0-based) takes the ``G = global_batch_size`` positions ``[s*G, (s+1)*G)`` of the endless sequence of
epochs, each epoch's last ``N mod G`` positions skipped (a global batch never spans two epochs). The
global batch is split into ``dp`` contiguous parts, part ``d`` for data-parallel replica ``d``, and each
part into ``accumulation = G / (micro_batch_size * dp)`` micro-batches of ``micro_batch_size`` rows.
Every row depends only on ``(seed, epoch, index)``, never on the batch or process it lands in, so
every ``(dp, micro_batch_size)`` layout of one ``G`` trains on identical global batches; the
tensor-parallel and pipeline ranks of a replica compute the same batches independently.

Synthetic data (``--data synthetic``, :class:`SyntheticData`) follows an input spec of
:func:`slapo_lab.spec.input_spec`; it is endless (``num_samples is None``, every step in epoch 0).

Evaluation (``--eval-data PATH``, :func:`eval_micro_batches`): the same files / tokenizer / packing,
in order, without shuffling; the same sequences at every layout (the last micro-batch is padded with rows
whose labels are ignored).

Errors a user can cause (a missing path or tokenizer directory, an unsupported file, a jsonl without
``text``, an empty corpus, a corpus shorter than one global batch, a bad batch layout) raise
:class:`DataError` (a ``ValueError``) whose ``str()`` is one sentence naming the file or setting and what
to do.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
from collections.abc import Iterable, Iterator, Sequence
from contextlib import AbstractContextManager
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from transformers import AutoTokenizer, DataCollatorForLanguageModeling, PreTrainedTokenizerBase

if TYPE_CHECKING:
    import datasets  # datasets (and its pyarrow) load only in a run that reads text files

from ..spec import objective_of  # noqa: F401 (re-exported: its home is the spec)
from .preflight import DATA_HINT as _DATA_HINT  # noqa: F401 (re-exported)
from .preflight import FILE_BUILDERS, DataError, data_files

OBJECTIVES = ("causal_lm", "masked_lm")
# The file kinds read, by extension: the ``datasets`` packaged builder that reads each.
SYNTHETIC = "synthetic"
IGNORE_INDEX = -100  # the label of a token no loss counts (torch's cross_entropy default, HF's convention)
# Masked-LM rule of ``DataCollatorForLanguageModeling``'s defaults.
MLM_PROBABILITY = 0.15
_FORMAT_VERSION = "slapo-lab-data-1"  # bump when tokenisation or packing changes: a new cache key


def _mix_seed(*parts: Any) -> int:
    """A 63-bit generator seed from ``parts`` (ints / strings), the same on every machine and process."""
    digest = hashlib.blake2b(repr(parts).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & (2**63 - 1)


def _generator(*parts: Any) -> torch.Generator:
    return torch.Generator().manual_seed(_mix_seed(*parts))


# ---------------------------------------------------------------------------------------------------------
# files


def _first_reason(err: BaseException) -> str:
    """The first line of the innermost useful message of ``err``, without a trailing period."""
    cause = err.__cause__ or err.__context__
    for e in (cause, err):
        text = str(e).strip() if e is not None else ""
        if text:
            return re.sub(r"\.\s+", "; ", text.splitlines()[0].rstrip("."))[:300]
    return type(err).__name__


def _check_text_field(f: Path) -> None:
    """Cheap pre-checks that name the file: a jsonl's first object and a parquet's schema have ``text``."""
    kind = f.suffix.lower()
    if kind == ".jsonl":
        with open(f, encoding="utf-8", errors="replace") as fh:
            first = next((line for line in fh if line.strip()), None)
        if first is None:
            return
        try:
            obj = json.loads(first)
        except ValueError as err:
            raise DataError(
                f"The first line of {f} is not valid JSON ({str(err).rstrip('.')}); write one "
                'JSON object per line, e.g. {"text": "..."}.'
            ) from None
        if not isinstance(obj, dict) or "text" not in obj:
            raise DataError(
                f'The jsonl file {f} has no "text" field in its first object; write one object '
                'per line with the document in "text", e.g. {"text": "..."}.'
            )
    elif kind == ".parquet":
        import pyarrow.parquet as pq  # noqa: PLC0415 - datasets (and its pyarrow) load only in a run that reads text files

        try:
            names = pq.read_schema(f).names
        except Exception as err:  # noqa: BLE001 - any unreadable file is one sentence
            raise DataError(
                f"The parquet file {f} could not be read ({_first_reason(err)}); pass a valid "
                "parquet file with a text column."
            ) from None
        if "text" not in names:
            raise DataError(
                f"The parquet file {f} has no text column (it has {', '.join(names) or 'none'}); "
                "rename the column that holds the documents to text."
            )


def _load_files(files: list[Path], builder: str, cache_dir):
    """One ``load_dataset`` call on ``files`` (one builder): a Dataset with one string column ``text``."""
    import datasets  # noqa: PLC0415 - datasets (and its pyarrow) load only in a run that reads text files

    kwargs = {"columns": ["text"]} if builder == "parquet" else {}
    # builder is a packaged builder of FILE_BUILDERS (text/json/parquet), never a dataset script or hub name
    ds = datasets.load_dataset(
        builder, data_files=[str(f) for f in files], split="train", cache_dir=cache_dir, **kwargs
    )
    if "text" not in ds.column_names:
        raise DataError(f'The file {files[0]} has no "text" field; put each document in "text".')
    feature = ds.features["text"]
    if getattr(feature, "dtype", None) not in ("string", "large_string"):
        raise DataError(
            f'The "text" field of {files[0]} is not a string in every row; write each document as a '
            "JSON string."
        )
    ds = ds.select_columns(["text"])
    if feature.dtype != "string":
        ds = ds.cast_column("text", datasets.Value("string"))
    return ds


def _load_run(files: list[Path], builder: str, cache_dir) -> list:
    """Load consecutive files of one kind together; if that fails, one by one, to name the failing file."""
    try:
        return [_load_files(files, builder, cache_dir)]
    except DataError:
        if len(files) == 1:
            raise
    except Exception as err:  # noqa: BLE001 - any unreadable file is one sentence
        if len(files) == 1:
            raise DataError(
                f"The data file {files[0]} could not be read as {builder} ({_first_reason(err)}); "
                "fix or remove it."
            ) from None
    return [ds for f in files for ds in _load_run([f], builder, cache_dir)]


def load_corpus(files: list[Path], cache_dir: str | os.PathLike | None = None) -> datasets.Dataset | None:
    """The documents of ``files`` in order: a ``datasets.Dataset`` with one string column ``text``.

    Zero-byte files are skipped. Consecutive files of one kind are read by one ``load_dataset`` call.

    Raises:
        DataError: one sentence naming the file that is unreadable or lacks a text field.

    Returns None when every file is empty.
    """
    import datasets  # noqa: PLC0415 - datasets (and its pyarrow) load only in a run that reads text files

    files = [f for f in files if f.stat().st_size > 0]
    if not files:
        return None
    for f in files:
        _check_text_field(f)
    runs: list[tuple[str, list[Path]]] = []
    for f in files:
        builder = FILE_BUILDERS[f.suffix.lower()]
        if runs and runs[-1][0] == builder:
            runs[-1][1].append(f)
        else:
            runs.append((builder, [f]))
    parts = [ds for builder, run in runs for ds in _load_run(run, builder, cache_dir)]
    return parts[0] if len(parts) == 1 else datasets.concatenate_datasets(parts)


def load_tokenizer(tokenizer_dir: str | os.PathLike | None) -> PreTrainedTokenizerBase:
    """``AutoTokenizer.from_pretrained(tokenizer_dir)`` of a local directory written by ``save_pretrained``.

    Raises:
        DataError: when ``tokenizer_dir`` is None, does not exist or does not hold a tokenizer.
    """
    if tokenizer_dir is None:
        raise DataError(
            "Training on text files needs a tokenizer; pass --tokenizer DIR, a directory written by "
            "tokenizer.save_pretrained(DIR)."
        )
    d = Path(tokenizer_dir)
    if not d.is_dir():
        raise DataError(
            f"The tokenizer directory {d} does not exist; pass --tokenizer a directory written by "
            "tokenizer.save_pretrained(DIR)."
        )

    try:
        return AutoTokenizer.from_pretrained(str(d), local_files_only=True)
    except Exception as err:  # noqa: BLE001 - any failure to load is one sentence
        raise DataError(
            f"The tokenizer directory {d} could not be loaded ({_first_reason(err)}); pass --tokenizer a "
            "directory written by tokenizer.save_pretrained(DIR)."
        ) from None


def separator_id(tokenizer: PreTrainedTokenizerBase, tokenizer_dir: str | os.PathLike | None) -> int:
    """The id put after every document: the tokenizer's EOS token, else its SEP token.

    Raises:
        DataError: when the tokenizer has neither.
    """
    for tid in (tokenizer.eos_token_id, tokenizer.sep_token_id):
        if tid is not None:
            return int(tid)
    raise DataError(
        f"The tokenizer in {tokenizer_dir} has neither an eos nor a sep token to put between "
        "documents; set eos_token on it and save it again."
    )


def _dir_fingerprint(d: Path) -> str:
    """A hash of the files directly in ``d`` (names and contents): the tokenizer's identity for caching."""
    h = hashlib.sha256()
    for f in sorted(p for p in d.iterdir() if p.is_file()):
        h.update(f.name.encode() + b"\0" + f.read_bytes() + b"\0")
    return h.hexdigest()[:32]


def _cache_file(ds, name: str) -> str | None:
    """A cache file path next to ``ds``'s own cache files (None for an in-memory dataset)."""
    files = getattr(ds, "cache_files", None) or []
    return os.path.join(os.path.dirname(files[0]["filename"]), name) if files else None


def tokenize_documents(
    corpus: datasets.Dataset, tokenizer: PreTrainedTokenizerBase, sep_id: int, tokenizer_key: str
) -> datasets.Dataset:
    """Tokenise ``corpus`` (column ``text``) in a batched, cached map: one row per non-blank document with
    ``input_ids`` (int32, the document's ids without special tokens, then ``sep_id``) and ``length``."""
    import datasets  # noqa: PLC0415 - datasets (and its pyarrow) load only in a run that reads text files

    def tokenize(batch):
        texts = [t for t in batch["text"] if t is not None and t.strip()]
        ids = tokenizer(texts, add_special_tokens=False)["input_ids"] if texts else []
        ids = [x + [sep_id] for x in ids if x]
        return {"input_ids": ids, "length": [len(x) for x in ids]}

    from datasets.fingerprint import Hasher  # noqa: PLC0415 - datasets (and its pyarrow) load only in a run that reads text files

    fp = Hasher.hash([_FORMAT_VERSION, "tokenize", corpus._fingerprint, tokenizer_key, sep_id])
    features = datasets.Features(
        {"input_ids": datasets.List(datasets.Value("int32")), "length": datasets.Value("int64")}
    )
    return corpus.map(
        tokenize,
        batched=True,
        remove_columns=corpus.column_names,
        features=features,
        new_fingerprint=fp,
        desc="Tokenizing",
    )


def pack_sequences(docs: datasets.Dataset, seq_len: int) -> tuple[datasets.Dataset, int]:
    """Cut the token stream of ``docs`` (rows of ``input_ids``, in order) into ``seq_len``-token rows in a
    batched, cached map over the sequence numbers; the final partial sequence is dropped.

    Returns:
        ``(packed, num_tokens)``: a Dataset with one column ``input_ids`` of fixed length ``seq_len``
        (int32), and the number of tokens of the stream (separators included).
    """
    import datasets  # noqa: PLC0415 - datasets (and its pyarrow) load only in a run that reads text files
    import pyarrow.compute as pc  # noqa: PLC0415 - datasets (and its pyarrow) load only in a run that reads text files
    from datasets.fingerprint import Hasher  # noqa: PLC0415 - datasets (and its pyarrow) load only in a run that reads text files

    table = docs.with_format("arrow")
    ends = np.cumsum(table[:]["length"].to_numpy().astype(np.int64))  # arrow column: no per-row formatting
    num_tokens = int(ends[-1]) if len(ends) else 0
    n_seq = num_tokens // seq_len

    def pack(batch):
        k0, k1 = int(batch["seq"][0]), int(batch["seq"][-1]) + 1  # batches are contiguous runs
        t0, t1 = k0 * seq_len, k1 * seq_len
        d0 = int(np.searchsorted(ends, t0, side="right"))  # the document holding token t0
        d1 = int(np.searchsorted(ends, t1 - 1, side="right"))
        flat = pc.list_flatten(table[d0 : d1 + 1]["input_ids"]).to_numpy()
        start = t0 - (int(ends[d0 - 1]) if d0 else 0)
        return {"input_ids": flat[start : start + t1 - t0].reshape(k1 - k0, seq_len)}

    fp = Hasher.hash([_FORMAT_VERSION, "pack", docs._fingerprint, seq_len])
    features = datasets.Features({"input_ids": datasets.List(datasets.Value("int32"), length=seq_len)})
    seqs = datasets.Dataset.from_dict({"seq": np.arange(n_seq, dtype=np.int64)})
    packed = seqs.map(
        pack,
        batched=True,
        batch_size=1000,
        remove_columns=["seq"],
        features=features,
        new_fingerprint=fp,
        cache_file_name=_cache_file(docs, f"packed-{fp}.arrow"),
        desc="Packing",
    )
    return packed, num_tokens


# ---------------------------------------------------------------------------------------------------------
# datasets


class TokenData:
    """Packed token sequences of local text files (build with :meth:`from_files`).

    Attributes:
        source: the ``--data`` path as given.
        files: the files read, in order (``list[str]``).
        num_documents: documents with at least one token.
        num_tokens: tokens of all documents, separators included (before the final partial sequence
            is dropped).
        num_samples: packed sequences ``N = num_tokens // seq_len``.
        seq_len: tokens per sequence.
        objective: ``"causal_lm"`` or ``"masked_lm"``.
        seed: the seed of the masked-LM choices (and, through :class:`BatchPlan`, of the order).
        tokenizer_dir: the tokenizer directory.
    """

    def __init__(
        self,
        packed: datasets.Dataset,
        *,
        source: str | os.PathLike,
        files: Iterable[str | os.PathLike],
        num_documents: int,
        num_tokens: int,
        seq_len: int,
        objective: str,
        seed: int,
        tokenizer: PreTrainedTokenizerBase,
        tokenizer_dir: str | os.PathLike,
    ) -> None:
        self._packed = packed.with_format("numpy")
        self.source = str(source)
        self.files = [str(f) for f in files]
        self.num_documents = int(num_documents)
        self.num_tokens = int(num_tokens)
        self.num_samples = len(packed)
        self.seq_len = int(seq_len)
        self.objective = objective
        self.seed = int(seed)
        self.tokenizer = tokenizer
        self.tokenizer_dir = str(tokenizer_dir)
        self._collator = None
        if objective == "masked_lm":
            self._collator = DataCollatorForLanguageModeling(
                tokenizer, mlm=True, mlm_probability=MLM_PROBABILITY
            )
            self._special_ids = torch.tensor(sorted(set(tokenizer.all_special_ids)), dtype=torch.long)

    @classmethod
    def from_files(
        cls,
        path: str | os.PathLike,
        tokenizer_dir: str | os.PathLike | None,
        seq_len: int,
        *,
        objective: str,
        seed: int,
        main_first: AbstractContextManager | None = None,
        cache_dir: str | os.PathLike | None = None,
    ) -> TokenData:
        """Read, tokenise and pack the files of ``path`` (see the module docstring).

        Args:
            path: a ``.txt`` / ``.jsonl`` / ``.parquet`` file or a directory of them.
            tokenizer_dir: a directory written by ``tokenizer.save_pretrained``.
            seq_len: tokens per packed sequence (>= 1).
            objective: ``"causal_lm"`` or ``"masked_lm"`` (which needs a tokenizer with a mask token).
            seed: the seed of the masked-LM choices (the order's seed is :class:`BatchPlan`'s).
            main_first: a context manager entered around all reading and tokenising; the runtime passes
                one that lets rank 0 through first and the other ranks after a barrier, so that they
                read rank 0's cached results (default: ``contextlib.nullcontext()``). Rank 0 may leave it
                by an exception (an empty corpus): its barrier belongs in a ``finally``, so that the
                others go on and raise the same error.
            cache_dir: the ``datasets`` cache (default: ``$HF_HOME/datasets``); the tokenised and
                packed datasets are cached next to the loaded files' cache.

        Raises:
            DataError: one sentence naming the file or directory: a missing path or tokenizer directory,
                an unsupported extension, a jsonl / parquet file without text, unreadable files, an
                empty corpus, one shorter than one sequence, a tokenizer without eos / sep token (or,
                for masked_lm, mask token), an unknown objective or a ``seq_len`` below 1.
        """
        if objective not in OBJECTIVES:
            raise DataError(
                f"The objective {objective!r} is not one of {', '.join(OBJECTIVES)}; training on "
                "text files needs a causal or masked language model."
            )
        if not isinstance(seq_len, int) or seq_len < 1:
            raise DataError(
                f"The sequence length must be a positive number of tokens, not {seq_len!r}; pass --seq-len N."
            )
        files = data_files(path)
        tokenizer = load_tokenizer(tokenizer_dir)
        sep_id = separator_id(tokenizer, tokenizer_dir)
        if objective == "masked_lm" and tokenizer.mask_token_id is None:
            raise DataError(
                f"The tokenizer in {tokenizer_dir} has no mask token, which masked_lm training "
                "needs; set mask_token on it and save it again."
            )
        with main_first if main_first is not None else contextlib.nullcontext():
            corpus = load_corpus(files, cache_dir)
            docs = None
            if corpus is not None:
                docs = tokenize_documents(corpus, tokenizer, sep_id, _dir_fingerprint(Path(tokenizer_dir)))
            if docs is None or len(docs) == 0:
                raise DataError(
                    f"The data at {path} holds no text (every document is empty); put documents in it "
                    "(one per line in a .txt file) or pass --data other files."
                )
            packed, num_tokens = pack_sequences(docs, seq_len)
        if len(packed) == 0:
            raise DataError(
                f"The data at {path} has {num_tokens:,} tokens, fewer than one sequence of "
                f"{seq_len} tokens; add text or pass a smaller --seq-len."
            )
        return cls(
            packed,
            source=path,
            files=files,
            num_documents=len(docs),
            num_tokens=num_tokens,
            seq_len=seq_len,
            objective=objective,
            seed=seed,
            tokenizer=tokenizer,
            tokenizer_dir=tokenizer_dir,
        )

    def describe(self) -> str:
        """One line for the log, e.g. ``data: 3 files, 400 documents, 51,234 tokens -> 400 sequences of
        128 tokens (causal_lm)``."""
        n = len(self.files)
        return (
            f"data: {n} file{'s' if n != 1 else ''}, {self.num_documents:,} documents, {self.num_tokens:,} "
            f"tokens -> {self.num_samples:,} sequences of {self.seq_len} tokens ({self.objective})"
        )

    def tokens(self, indices: Sequence[int]) -> torch.Tensor:
        """The packed token ids of sequences ``indices``: LongTensor ``(len(indices), seq_len)``."""
        idx = [int(i) for i in indices]
        if not idx:
            return torch.empty(0, self.seq_len, dtype=torch.long)
        if min(idx) < 0 or max(idx) >= self.num_samples:
            raise IndexError(
                f"sequence indices must lie in [0, {self.num_samples}), got {min(idx)}..{max(idx)}"
            )
        rows = np.asarray(self._packed[idx]["input_ids"]).reshape(len(idx), self.seq_len)
        return torch.from_numpy(rows.astype(np.int64))

    def batch(self, indices: Sequence[int], epoch: int) -> dict[str, torch.Tensor]:
        """Samples ``indices`` (sequence numbers in ``[0, num_samples)``) stacked in that order.

        Returns:
            ``{"input_ids": LongTensor (len(indices), seq_len), "labels": LongTensor (same shape)}``;
            causal_lm: labels equal the ids (a separate tensor); masked_lm: ids masked and labels -100
            except at chosen positions, row ``r`` drawn from a generator seeded by
            ``(seed, epoch, indices[r])`` alone.

        Raises:
            IndexError: for an index outside ``[0, num_samples)``.
        """
        ids = self.tokens(indices)
        if self.objective == "causal_lm":
            return {"input_ids": ids, "labels": ids.clone()}
        rows, labels = [], []
        for i, row in zip(indices, ids, strict=False):
            inputs, lab = self.mask_row(row, epoch, int(i))
            rows.append(inputs)
            labels.append(lab)
        if not rows:
            return {"input_ids": ids, "labels": ids.clone()}
        return {"input_ids": torch.stack(rows), "labels": torch.stack(labels)}

    def mask_row(self, row: torch.Tensor, epoch: int, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The masked-LM ``(input_ids, labels)`` of one sequence ``row`` (LongTensor ``(seq_len,)``):
        ``DataCollatorForLanguageModeling.torch_mask_tokens`` run with a generator seeded by
        ``(seed, epoch, index)``; special tokens are never chosen."""
        special = torch.isin(row, self._special_ids)
        self._collator.generator = _generator(self.seed, epoch, index)
        try:
            inputs, labels = self._collator.torch_mask_tokens(
                row.unsqueeze(0).clone(), special_tokens_mask=special.unsqueeze(0)
            )
        finally:
            self._collator.generator = None
        return inputs[0], labels[0]


class SyntheticData:
    """Endless synthetic inputs like the example inputs (``--data synthetic``): ``num_samples is None``.

    ``input_spec`` comes from :func:`slapo_lab.spec.input_spec`: name -> ``{"shape", "dims",
    "dtype", "low"/"high" | "fill"}`` or ``{"value": v}``. In :meth:`batch`, axis ``"batch"`` becomes the
    number of rows and ``"seq"`` becomes ``seq_len``; integer inputs are uniform in ``[low, high)`` (or
    ``fill``), floating inputs standard normal (in ``float_dtype`` when given), ``{"value": v}`` passes
    ``v`` through. Row ``r`` of a batch is drawn from a generator seeded by ``(seed, epoch, indices[r])``
    alone; :class:`BatchPlan` passes epoch 0 and the position ``s*G + i`` in the endless stream, so sample
    ``i`` of step ``s`` depends on ``(seed, s, i)`` only, never on the layout. Inputs without a batch axis
    are drawn once per name (seeded by ``seed`` and the name), the same in every batch. ``lm_labels``
    adds ``labels`` equal to ``input_ids``.
    """

    num_samples = None

    def __init__(
        self,
        input_spec: dict,
        seq_len: int | None,
        seed: int,
        *,
        lm_labels: bool = False,
        float_dtype: torch.dtype | None = None,
    ):
        if not isinstance(input_spec, dict) or not input_spec:
            raise DataError(
                "Synthetic data needs the input spec of the example inputs; export the script again "
                "from a schedule with example inputs."
            )
        if lm_labels and "input_ids" not in input_spec:
            raise DataError(
                "Synthetic data with LM labels needs an input_ids input; the example inputs have "
                f"only {', '.join(input_spec)}."
            )
        if seq_len is None and any("seq" in e.get("dims", ()) for e in input_spec.values()):
            raise DataError(
                "Synthetic data of the example's shapes needs --seq-len (a sequence axis has no length)."
            )
        self.input_spec = input_spec
        self.seq_len = None if seq_len is None else int(seq_len)
        self.seed = int(seed)
        self.lm_labels = lm_labels
        self.float_dtype = float_dtype

    def describe(self) -> str:
        """One line for the log, e.g. ``data: synthetic inputs like the example's (input_ids int64
        (batch, 128)), seed 0``."""
        parts = []
        for name, spec in self.input_spec.items():
            if "value" in spec:
                parts.append(f"{name}={spec['value']!r}")
                continue
            dims = ", ".join(
                "batch" if d == "batch" else str(self.seq_len if d == "seq" else d) for d in spec["dims"]
            )
            parts.append(f"{name} {spec['dtype']} ({dims})")
        labels = ", labels = input_ids" if self.lm_labels else ""
        return f"data: synthetic inputs like the example's ({'; '.join(parts)}{labels}), seed {self.seed}"

    def _draw(self, spec: dict, shape: list, gen: torch.Generator) -> torch.Tensor:
        dtype = getattr(torch, spec["dtype"])
        if "fill" in spec:
            return torch.full(shape, spec["fill"], dtype=dtype)
        if dtype.is_floating_point:
            return torch.randn(shape, generator=gen).to(self.float_dtype or dtype)
        return torch.randint(int(spec["low"]), int(spec["high"]), shape, generator=gen).to(dtype)

    def _shape(self, dims) -> list[int]:
        return [self.seq_len if d == "seq" else int(d) for d in dims]

    def batch(self, indices: Sequence[int], epoch: int) -> dict[str, Any]:
        """Synthetic samples ``indices`` stacked along the batch axis.

        Returns:
            name -> tensor whose ``"batch"`` axis has ``len(indices)`` rows and ``"seq"`` axes
            ``seq_len``, or the spec's ``value``; plus ``labels`` (a copy of ``input_ids``) with
            ``lm_labels``.
        """
        out: dict[str, Any] = {}
        gens = [_generator(self.seed, epoch, int(i)) for i in indices]
        for name, spec in self.input_spec.items():
            if "value" in spec:
                out[name] = spec["value"]
            elif spec["dims"] and spec["dims"][0] == "batch":
                shape = self._shape(spec["dims"][1:])
                rows = [self._draw(spec, shape, g) for g in gens]
                out[name] = torch.stack(rows) if rows else self._draw(spec, [0, *shape], torch.Generator())
            else:
                out[name] = self._draw(spec, self._shape(spec["dims"]), _generator(self.seed, "fixed", name))
        if self.lm_labels:
            out["labels"] = out["input_ids"].clone()
        return out


def _positive_int(value, what: str, flag: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise DataError(f"The {what} must be a positive whole number, not {value!r}; pass {flag} N.")
    return value


class BatchPlan:
    """Which samples data-parallel replica ``dp_rank`` trains on at each optimizer step.

    Args:
        num_samples: ``N``, the data's sequences (``TokenData.num_samples``), or None for endless
            (synthetic) data.
        global_batch_size: ``G``, samples per optimizer step over all replicas.
        micro_batch_size: rows per forward / backward pass of one replica.
        dp_size: data-parallel replicas ``dp``; ``dp_rank``: this replica, in ``[0, dp)``.
        seed: the seed of the epoch order (``torch.randperm(N, generator=manual_seed(seed + epoch))``).
        source: the data path, named in the error when ``N < G``.

    Attributes:
        accumulation: micro-batches per step and replica, ``G / (micro_batch_size * dp)``.
        steps_per_epoch: ``N // G``, or None for endless data.

    Raises:
        DataError: one sentence when a size is not a positive whole number, ``dp_rank`` is outside
            ``[0, dp)``, ``G`` is not divisible by ``micro_batch_size * dp``, or ``N < G``.
    """

    def __init__(
        self,
        num_samples: int | None,
        global_batch_size: int,
        micro_batch_size: int,
        dp_size: int,
        dp_rank: int,
        seed: int,
        *,
        source: str | None = None,
    ):
        G = _positive_int(global_batch_size, "global batch size", "--global-batch-size")
        m = _positive_int(micro_batch_size, "micro-batch size", "--micro-batch-size")
        dp = _positive_int(dp_size, "data-parallel size", "--dp")
        if not 0 <= dp_rank < dp:
            raise DataError(
                f"The data-parallel rank {dp_rank} is outside [0, {dp}); the mesh gave a wrong rank."
            )
        if G % (m * dp):
            raise DataError(
                f"The global batch size {G} is not divisible by micro-batch size {m} x {dp} "
                f"data-parallel replicas; pass a --global-batch-size that is a multiple of {m * dp}."
            )
        if num_samples is not None and num_samples < G:
            where = f"The data at {source}" if source else "The data"
            raise DataError(
                f"{where} has {num_samples:,} sequences, fewer than one global batch of {G}; add "
                "text, or pass a smaller --global-batch-size or --seq-len."
            )
        self.num_samples = num_samples
        self.global_batch_size = G
        self.micro_batch_size = m
        self.dp_size = dp
        self.dp_rank = dp_rank
        self.seed = int(seed)
        self.accumulation = G // (m * dp)
        self.steps_per_epoch = None if num_samples is None else num_samples // G
        self._perm: tuple[int, torch.Tensor] | None = None

    def epoch(self, step: int) -> int:
        """The epoch of 0-based step ``step`` (always 0 for endless data)."""
        return 0 if self.steps_per_epoch is None else step // self.steps_per_epoch

    def order(self, epoch: int) -> torch.Tensor:
        """Epoch ``epoch``'s order of the ``N`` samples: LongTensor ``(N,)``, a permutation."""
        if self._perm is None or self._perm[0] != epoch:
            gen = torch.Generator().manual_seed(self.seed + epoch)
            self._perm = (epoch, torch.randperm(self.num_samples, generator=gen))
        return self._perm[1]

    def global_indices(self, step: int) -> tuple[list[int], int]:
        """``(indices, epoch)`` of the whole global batch of 0-based step ``step``: the ``G`` sample numbers
        (positions in the endless stream, for endless data) in batch order."""
        if step < 0:
            raise DataError(f"The step must be 0 or more, not {step}.")
        G = self.global_batch_size
        if self.steps_per_epoch is None:
            return list(range(step * G, (step + 1) * G)), 0
        e, within = divmod(step, self.steps_per_epoch)
        return self.order(e)[within * G : (within + 1) * G].tolist(), e

    def micro_batch_indices(self, step: int) -> tuple[list[list[int]], int]:
        """``(per micro-batch sample numbers, epoch)`` of this replica at 0-based step ``step``."""
        indices, e = self.global_indices(step)
        part = self.global_batch_size // self.dp_size
        mine = indices[self.dp_rank * part : (self.dp_rank + 1) * part]
        m = self.micro_batch_size
        return [mine[k * m : (k + 1) * m] for k in range(self.accumulation)], e

    def micro_batches(self, data: TokenData | SyntheticData, step: int) -> list[dict[str, torch.Tensor]]:
        """This replica's ``accumulation`` micro-batches of 0-based step ``step``: ``data.batch(...)`` dicts
        of ``micro_batch_size`` rows each (token data: ``input_ids`` / ``labels`` of shape
        ``(micro_batch_size, seq_len)``)."""
        groups, e = self.micro_batch_indices(step)
        return [data.batch(g, e) for g in groups]


class _EvalBatches:
    """Iterator over one replica's evaluation micro-batches; ``len()`` is the number still to come."""

    def __init__(self, data: TokenData, groups: list[list[int | None]]):
        self._data = data
        self._groups = groups
        self._next = 0

    def __iter__(self):
        return self

    def __len__(self) -> int:
        return len(self._groups) - self._next

    def __next__(self) -> dict[str, torch.Tensor]:
        if self._next >= len(self._groups):
            raise StopIteration
        g = self._groups[self._next]
        self._next += 1
        real = [i for i in g if i is not None]
        batch = self._data.batch(real + [real[-1] if real else 0] * (len(g) - len(real)), 0)
        batch["labels"][len(real) :] = IGNORE_INDEX  # padding rows: a forward of the same shape, no loss
        return batch


def eval_micro_batches(
    data: TokenData,
    micro_batch_size: int,
    dp_size: int,
    dp_rank: int,
    max_samples: int | None = None,
    group: int = 1,
) -> Iterator[dict[str, torch.Tensor]]:
    """This replica's evaluation micro-batches, in order, without shuffling.

    The first ``min(max_samples, N)`` sequences (all by default), every one of them at every layout: cut
    into micro-batches of ``micro_batch_size`` rows, the last one padded to that size, and those into groups
    of ``group`` consecutive micro-batches (a pipeline's batch; 1 otherwise), the last group padded with
    micro-batches of padding rows; group ``k`` goes to replica ``k % dp`` (a replica may get one group
    fewer, or none). A padding row repeats a real sequence (the shapes stay fixed for pipelines and
    compiled blocks) with every label ``-100`` (:data:`IGNORE_INDEX`), so a loss summed over labelled
    tokens and divided by their count is the same whatever the layout. Masked-LM choices use epoch 0.
    The returned iterator supports ``len()`` (micro-batches still to come).

    Returns:
        An iterator of ``{"input_ids", "labels"}`` dicts of LongTensors ``(micro_batch_size, seq_len)``.

    Raises:
        DataError: when a size is not positive or ``dp_rank`` is outside ``[0, dp)`` (one sentence).
    """
    m = _positive_int(micro_batch_size, "micro-batch size", "--micro-batch-size")
    dp = _positive_int(dp_size, "data-parallel size", "--dp")
    g = _positive_int(group, "pipeline micro-batch count", "--global-batch-size")
    if not 0 <= dp_rank < dp:
        raise DataError(f"The data-parallel rank {dp_rank} is outside [0, {dp}); the mesh gave a wrong rank.")
    n = eval_sample_count(data, max_samples)
    rows: list[int | None] = list(range(n))
    rows += [None] * (-n % (m * g))
    batches = [rows[k * m : (k + 1) * m] for k in range(len(rows) // m)]
    groups = [batches[k * g : (k + 1) * g] for k in range(len(batches) // g)]
    mine = [b for k, grp in enumerate(groups) if k % dp == dp_rank for b in grp]
    return _EvalBatches(data, mine)


def eval_sample_count(data: TokenData, max_samples: int | None = None) -> int:
    """The number of sequences an evaluation reads: ``min(max_samples, N)`` (all ``N`` by default).

    Raises:
        DataError: when ``max_samples`` is not positive.
    """
    if max_samples is None:
        return data.num_samples
    return min(_positive_int(max_samples, "number of evaluation samples", "--eval-samples"), data.num_samples)


def load_data(
    spec: str,
    *,
    tokenizer_dir: str | os.PathLike | None = None,
    seq_len: int,
    objective: str | None,
    seed: int,
    input_spec: dict | None = None,
    main_first: AbstractContextManager | None = None,
    lm_labels: bool = False,
    cache_dir: str | os.PathLike | None = None,
    float_dtype: torch.dtype | None = None,
) -> TokenData | SyntheticData:
    """The training data of ``--data spec``: :class:`SyntheticData` for ``"synthetic"`` (from
    ``input_spec``; ``lm_labels`` adds labels, ``float_dtype`` casts floating inputs), else
    :class:`TokenData.from_files` of the path (``objective`` from :func:`objective_of`).

    Raises:
        DataError: one sentence: everything :meth:`TokenData.from_files` raises, a path given for a model
            without a language-model objective (``objective is None``), or synthetic data without an
            input spec.
    """
    if spec == SYNTHETIC:
        return SyntheticData(input_spec, seq_len, seed, lm_labels=lm_labels, float_dtype=float_dtype)
    if objective is None:
        raise DataError(
            f"Training on the text at {spec} needs a language-model class (*ForCausalLM, "
            "*LMHeadModel or *ForMaskedLM); pass --data synthetic for this model."
        )
    return TokenData.from_files(
        spec,
        tokenizer_dir,
        seq_len,
        objective=objective,
        seed=seed,
        main_first=main_first,
        cache_dir=cache_dir,
    )
