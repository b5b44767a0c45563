"""Tests of the training input pipeline (train/input_pipeline.py, train/data/).

References are independent of the implementation: the documented sampling contract
(``default_rng([seed, 0, epoch]).permutation(N)``) recomputed here, raw bytes of the
source texts, naive loops for crops and span search, and hand-computed SQuAD scores.
"""

from __future__ import annotations

import contextlib
from pydoc_data.topics import topics

import numpy as np
import pytest

from train.data import cache, sampling
from train.data.images import CIFAR100_MEAN, CIFAR100_STD, random_crop_and_flip
from train.data.language_modeling import LanguageModelingDataset
from train.data.squad import (
    SquadExample,
    WordPieceTokenizer,
    best_spans,
    build_features,
    exact_match_score,
    f1_score,
    normalize_answer,
)
from train.data.tokenization import HuggingFaceTokenizer, iter_text_chunks
from train.input_pipeline import get_dataset


def reference_indices(seed: int, num_examples: int, step: int, batch: int) -> np.ndarray:
    """Example indices of global batch ``step`` from the documented contract."""
    positions = step * batch + np.arange(batch)
    return np.array(
        [
            np.random.default_rng([seed, 0, p // num_examples]).permutation(num_examples)[
                p % num_examples
            ]
            for p in positions
        ]
    )


def assert_batches_equal(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for key in a:
        assert a[key].dtype == b[key].dtype, key
        np.testing.assert_array_equal(a[key], b[key], err_msg=key)


def concat_batches(parts: list[dict]) -> dict:
    return {key: np.concatenate([p[key] for p in parts]) for key in parts[0]}


def check_process_split(dataset, step: int, batch: int, process_count: int) -> None:
    whole = dataset.train_batch(step, batch)
    parts = [dataset.train_batch(step, batch, i, process_count) for i in range(process_count)]
    assert_batches_equal(concat_batches(parts), whole)


def check_eval_process_split(dataset, batch: int, process_count: int) -> None:
    whole = list(dataset.eval_batches(batch))
    per_process = [
        list(dataset.eval_batches(batch, i, process_count)) for i in range(process_count)
    ]
    assert all(len(p) == len(whole) for p in per_process)
    for number, global_batch in enumerate(whole):
        assert_batches_equal(concat_batches([p[number] for p in per_process]), global_batch)


# ----------------------------------------------------------------------------- config


def test_unknown_name_lists_valid_names():
    with pytest.raises(ValueError, match=r"unknown dataset name 'mnist'.*cifar100.*digits"):
        get_dataset({"name": "mnist"}, seed=0)


def test_unknown_and_missing_fields_are_errors():
    with pytest.raises(ValueError, match=r"no config field\(s\) \['contextlength'\]"):
        get_dataset({"name": "pydoc_text", "contextlength": 64}, seed=0)
    with pytest.raises(ValueError, match=r"needs config field\(s\) \['eval_files'"):
        get_dataset({"name": "text_files", "train_files": "x"}, seed=0)


def test_accepts_configdict_and_none_fields():
    ml_collections = pytest.importorskip("ml_collections")
    config = ml_collections.ConfigDict(
        {"name": "pydoc_text", "data_dir": None, "context_length": None}
    )
    dataset = get_dataset(ml_collections.FrozenConfigDict(config), seed=3)
    assert dataset.context_length == 128


# ------------------------------------------------------------------------ sampling


def test_batch_size_must_divide_among_processes():
    with pytest.raises(ValueError, match="not divisible by process_count=3"):
        sampling.local_rows(8, 0, 3)
    with pytest.raises(ValueError, match="process_index"):
        sampling.local_rows(8, 2, 2)
    with pytest.raises(ValueError, match="global_batch_size"):
        sampling.local_rows(0, 0, 1)


def test_epoch_order_matches_contract_and_caches():
    order = sampling.EpochOrder(7, seed=11)
    epochs, indices = order.lookup(np.arange(30))
    np.testing.assert_array_equal(epochs, np.arange(30) // 7)
    np.testing.assert_array_equal(indices, reference_indices(11, 7, 0, 30))
    assert order.permutation(2) is order.permutation(2)
    assert not order.permutation(2).flags.writeable


# -------------------------------------------------------------------------- digits


@pytest.fixture(scope="module")
def digits():
    return get_dataset({"name": "digits"}, seed=5)


def test_digits_shapes_split_and_standardization(digits):
    assert digits.task == "classification"
    assert (digits.num_classes, digits.input_shape) == (10, (8, 8, 1))
    assert (digits.num_train_examples, digits.num_eval_examples) == (1497, 300)
    batch = digits.train_batch(0, 64)
    assert batch["image"].shape == (64, 8, 8, 1) and batch["image"].dtype == np.float32
    assert batch["label"].shape == (64,) and batch["label"].dtype == np.int32
    train_images = digits._train_images
    assert abs(train_images.mean()) < 1e-5 and abs(train_images.std() - 1) < 1e-5
    # Train and eval images are disjoint.
    keys = {x.tobytes() for x in np.round(train_images, 4)}
    assert len(keys) == 1497
    assert not keys & {x.tobytes() for x in np.round(digits._eval_images, 4)}


def test_digits_determinism_and_resume(digits):
    again = get_dataset({"name": "digits"}, seed=5)
    for step in (7, 0, 31):  # any order: batches are a pure function of (seed, step)
        assert_batches_equal(digits.train_batch(step, 48), again.train_batch(step, 48))
    assert not np.array_equal(
        digits.train_batch(1, 48)["image"], digits.train_batch(2, 48)["image"]
    )
    other_seed = get_dataset({"name": "digits"}, seed=6)
    assert not np.array_equal(
        digits.train_batch(1, 48)["image"], other_seed.train_batch(1, 48)["image"]
    )


def test_digits_rows_follow_the_documented_order(digits):
    step, batch = 13, 200  # straddles the end of epoch 1
    expected = reference_indices(5, 1497, step, batch)
    got = digits.train_batch(step, batch)
    np.testing.assert_array_equal(got["image"], digits._train_images[expected])
    np.testing.assert_array_equal(got["label"], digits._train_labels[expected])


def test_digits_process_split(digits):
    for process_count in (2, 4):
        check_process_split(digits, step=9, batch=64, process_count=process_count)
    check_eval_process_split(digits, batch=64, process_count=4)


def test_digits_every_example_once_per_epoch(digits):
    batch = 499  # 3 batches per epoch; 6 batches = epochs 0 and 1
    seen = np.concatenate([digits.train_batch(s, batch)["image"] for s in range(6)])
    for epoch in range(2):
        rows = seen[epoch * 1497 : (epoch + 1) * 1497].reshape(1497, -1)
        order = np.lexsort(rows.T)
        reference = digits._train_images.reshape(1497, -1)
        np.testing.assert_array_equal(rows[order], reference[np.lexsort(reference.T)])


def test_digits_eval_covers_each_example_once_with_mask(digits):
    batches = list(digits.eval_batches(128))
    assert len(batches) == 3
    for batch in batches:
        assert batch["image"].shape == (128, 8, 8, 1) and batch["mask"].dtype == np.float32
    mask = np.concatenate([b["mask"] for b in batches])
    np.testing.assert_array_equal(mask, np.arange(384) < 300)
    images = np.concatenate([b["image"] for b in batches])
    np.testing.assert_array_equal(images[:300], digits._eval_images)
    assert not images[300:].any()


def test_step_and_seed_validation(digits):
    with pytest.raises(ValueError, match="step"):
        digits.train_batch(-1, 8)
    with pytest.raises(ValueError, match="seed"):
        get_dataset({"name": "pydoc_text"}, seed=-2)


# --------------------------------------------------------------------- pydoc text


def pydoc_bytes() -> bytes:
    return b"\n\n".join(topics[k].encode("utf-8") for k in sorted(topics))


def test_pydoc_windows_are_training_text():
    dataset = get_dataset({"name": "pydoc_text", "context_length": 64}, seed=1)
    assert dataset.task == "language_modeling"
    assert (dataset.vocab_size, dataset.context_length) == (256, 64)
    text = pydoc_bytes()
    split = int(0.9 * len(text))
    train, held_out = text[:split], text[split:]
    assert dataset.num_train_examples == (len(train) - 64) // 65
    batch = dataset.train_batch(3, 16)
    assert batch["tokens"].shape == (16, 65) and batch["tokens"].dtype == np.int32
    for row in batch["tokens"]:
        assert bytes(row.astype(np.uint8)) in train
    evals = list(dataset.eval_batches(32))
    real = np.concatenate([b["tokens"][b["mask"] > 0] for b in evals])
    assert len(real) == dataset.num_eval_examples == (len(held_out) - 1) // 64
    # Targets tile the evaluation text: every byte after the first is predicted once.
    targets = real[:, 1:].astype(np.uint8).tobytes()
    assert targets == held_out[1 : 1 + 64 * len(real)]
    np.testing.assert_array_equal(real[1:, 0], real[:-1, -1])


def make_lm(length: int, context_length: int, seed: int) -> LanguageModelingDataset:
    stream = np.arange(length, dtype=np.int32)  # a window is named by its first token
    return LanguageModelingDataset(
        train_tokens=stream,
        eval_tokens=stream[: length // 4],
        vocab_size=length,
        context_length=context_length,
        seed=seed,
    )


def test_lm_epochs_cover_all_windows_with_moving_offsets():
    dataset = make_lm(length=1000, context_length=9, seed=4)
    window = 10
    count = dataset.num_train_examples
    assert count == (1000 - 9) // 10 == 99
    batch = 33
    starts = np.concatenate(
        [dataset.train_batch(s, batch)["tokens"][:, 0] for s in range(4 * count // batch)]
    )
    offsets = set()
    for epoch in range(4):
        in_epoch = np.sort(starts[epoch * count : (epoch + 1) * count])
        offset = in_epoch[0]
        offsets.add(int(offset))
        assert 0 <= offset <= 9
        np.testing.assert_array_equal(in_epoch, offset + window * np.arange(count))
        assert in_epoch[-1] + window <= 1000
    assert len(offsets) > 1
    tokens = dataset.train_batch(2, batch)["tokens"]
    np.testing.assert_array_equal(tokens, tokens[:, :1] + np.arange(window))
    check_process_split(dataset, step=5, batch=batch + 3, process_count=4)
    check_eval_process_split(dataset, batch=8, process_count=2)


def test_lm_too_little_text_is_a_clear_error():
    with pytest.raises(ValueError, match="too few for one window"):
        make_lm(length=20, context_length=16, seed=0)


# ---------------------------------------------------------------------- text files


SAMPLE = "".join(topics[k] for k in sorted(topics)[:12])
WIKI_STYLE = " = Title = \n \n Some text , with numbers 1 @,@ 000 . \n\n = = Part = = \n  x\n\ny\n"


def test_text_files_bytes_are_the_file_bytes_and_cached(tmp_path, monkeypatch):
    (tmp_path / "a.txt").write_text(SAMPLE[:40000], encoding="utf-8")
    (tmp_path / "b.txt").write_text(WIKI_STYLE * 3, encoding="utf-8")
    (tmp_path / "valid.txt").write_text(SAMPLE[40000:50000], encoding="utf-8")
    config = {
        "name": "text_files",
        "train_files": str(tmp_path / "[ab].txt"),
        "eval_files": str(tmp_path / "valid.txt"),
        "context_length": 32,
        "cache_dir": str(tmp_path / "cache"),
    }
    dataset = get_dataset(config, seed=0)
    expected = (SAMPLE[:40000] + "\n\n" + WIKI_STYLE * 3).encode("utf-8")
    assert isinstance(dataset._train_tokens, np.memmap)
    assert dataset._train_tokens.tobytes() == expected
    assert dataset._eval_tokens.tobytes() == SAMPLE[40000:50000].encode("utf-8")
    entries = sorted(p.name for p in (tmp_path / "cache").iterdir())
    assert len(entries) == 2 and all(name.startswith("lm-files-") for name in entries)

    def no_rebuild(*args, **kwargs):
        raise AssertionError("the token stream was tokenized again instead of read from cache")

    monkeypatch.setattr(cache, "write_stream", no_rebuild)
    again = get_dataset(config, seed=0)
    assert sorted(p.name for p in (tmp_path / "cache").iterdir()) == entries
    assert_batches_equal(dataset.train_batch(4, 8), again.train_batch(4, 8))


def test_text_files_missing_file_says_where_to_get_wikitext(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"matches no file.*wikitext-103-raw-v1"):
        get_dataset(
            {
                "name": "text_files",
                "train_files": str(tmp_path / "wiki.train.raw"),
                "eval_files": str(tmp_path / "wiki.valid.raw"),
            },
            seed=0,
        )


@pytest.fixture(scope="module")
def byte_level_bpe(tmp_path_factory):
    tokenizers = pytest.importorskip("tokenizers")
    from tokenizers import decoders, models, pre_tokenizers, trainers

    tokenizer = tokenizers.Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=["<|endoftext|>"],
        show_progress=False,
    )
    tokenizer.train_from_iterator([SAMPLE, WIKI_STYLE], trainer)
    path = tmp_path_factory.mktemp("bpe") / "tokenizer.json"
    tokenizer.save(str(path))
    return tokenizer, str(path)


def test_chunked_bpe_equals_whole_text_bpe(byte_level_bpe):
    reference, path = byte_level_bpe
    text = (SAMPLE[:30000] + WIKI_STYLE * 40).replace("\n\n", "\n \n", 7)
    assert len(list(iter_text_chunks([text], 1000))) > 20
    chunked = HuggingFaceTokenizer(path, chunk_chars=1000, batch_chunks=3)
    pieces = [text[i : i + 777] for i in range(0, len(text), 777)]
    tokens = np.concatenate(list(chunked.encode_text(pieces)))
    np.testing.assert_array_equal(tokens, reference.encode(text).ids)


def test_text_files_with_bpe_tokenizer(byte_level_bpe, tmp_path):
    reference, path = byte_level_bpe
    (tmp_path / "train1.raw").write_text(SAMPLE[:20000], encoding="utf-8")
    (tmp_path / "train2.raw").write_text(WIKI_STYLE * 20, encoding="utf-8")
    (tmp_path / "valid.raw").write_text(SAMPLE[20000:26000], encoding="utf-8")
    dataset = get_dataset(
        {
            "name": "text_files",
            "train_files": [str(tmp_path / "train1.raw"), str(tmp_path / "train2.raw")],
            "eval_files": str(tmp_path / "valid.raw"),
            "tokenizer": path,
            "context_length": 16,
            "cache_dir": str(tmp_path / "cache"),
        },
        seed=0,
    )
    assert dataset.vocab_size == reference.get_vocab_size() == 400
    eos = reference.token_to_id("<|endoftext|>")
    expected = [*reference.encode(SAMPLE[:20000]).ids, eos, *reference.encode(WIKI_STYLE * 20).ids]
    np.testing.assert_array_equal(dataset._train_tokens, expected)
    assert dataset._train_tokens.dtype == np.uint16
    assert dataset.train_batch(0, 4)["tokens"].max() < 400


def test_missing_tokenizer_file_is_a_clear_error(tmp_path):
    (tmp_path / "t.raw").write_text("x" * 100)
    with pytest.raises(FileNotFoundError, match="openai-community/gpt2"):
        get_dataset(
            {
                "name": "text_files",
                "train_files": str(tmp_path / "t.raw"),
                "eval_files": str(tmp_path / "t.raw"),
                "tokenizer": str(tmp_path / "tokenizer.json"),
            },
            seed=0,
        )


# -------------------------------------------------------------------- tfds (mocked)


tfds = pytest.importorskip("tensorflow_datasets")


@contextlib.contextmanager
def mocked_tfds(**kwargs):
    with tfds.testing.mock_data(policy=tfds.testing.MockPolicy.USE_CODE, **kwargs):
        yield


def test_tfds_text_joins_records(tmp_path):
    with mocked_tfds(num_examples=6):
        dataset = get_dataset(
            {
                "name": "tfds_text",
                "tfds_name": "lm1b",
                "eval_split": "test",
                "context_length": 4,
                "cache_dir": str(tmp_path),
            },
            seed=0,
        )
        source = tfds.data_source("lm1b", split="train")
        texts = [source[i]["text"] for i in range(6)]
    expected = "\n\n".join(t if isinstance(t, str) else t.decode() for t in texts).encode()
    assert dataset._train_tokens.tobytes() == expected
    with mocked_tfds(num_examples=2), pytest.raises(ValueError, match=r"no field 'body'.*text"):
        get_dataset({"name": "tfds_text", "tfds_name": "lm1b", "text_key": "body"}, seed=0)


def test_tfds_not_prepared_says_how_to_build(tmp_path):
    with pytest.raises(FileNotFoundError) as info:
        get_dataset({"name": "cifar100", "data_dir": str(tmp_path)}, seed=0)
    message = str(info.value)
    assert f"tfds build cifar100 --data_dir={tmp_path} --file_format=array_record" in message
    assert "TensorFlow" in message and "internet" in message


@pytest.fixture()
def cifar():
    with mocked_tfds(num_examples=40):
        augmented = get_dataset({"name": "cifar100"}, seed=2)
        plain = get_dataset({"name": "cifar100", "augment": False}, seed=2)
        train = tfds.data_source("cifar100", split="train")
        test = tfds.data_source("cifar100", split="test")
        records = (
            np.stack([train[i]["image"] for i in range(40)]),
            np.array([train[i]["label"] for i in range(40)]),
            np.stack([test[i]["image"] for i in range(40)]),
        )
        yield augmented, plain, records


def normalized(images: np.ndarray) -> np.ndarray:
    return ((images / 255.0 - CIFAR100_MEAN) / CIFAR100_STD).astype(np.float32)


def test_random_crop_and_flip_against_loops():
    rng = np.random.default_rng(0)
    images = rng.integers(0, 256, size=(5, 6, 7, 3), dtype=np.uint8)
    offsets = rng.integers(0, 5, size=(5, 2))
    flips = np.array([True, False, True, False, True])
    got = random_crop_and_flip(images, offsets, flips, padding=2)
    for b in range(5):
        padded = np.zeros((10, 11, 3), np.uint8)
        padded[2:8, 2:9] = images[b]
        crop = padded[offsets[b, 0] : offsets[b, 0] + 6, offsets[b, 1] : offsets[b, 1] + 7]
        np.testing.assert_array_equal(got[b], crop[:, ::-1] if flips[b] else crop)


def test_cifar_batches(cifar):
    augmented, plain, (train_images, train_labels, test_images) = cifar
    assert (augmented.num_classes, augmented.input_shape) == (100, (32, 32, 3))
    assert augmented.num_train_examples == 40
    step, batch = 3, 16
    expected = reference_indices(2, 40, step, batch)
    got = plain.train_batch(step, batch)
    assert got["image"].dtype == np.float32 and got["label"].dtype == np.int32
    np.testing.assert_allclose(got["image"], normalized(train_images[expected]), atol=1e-6)
    np.testing.assert_array_equal(got["label"], train_labels[expected])
    # Augmented rows: each is one of the 9 x 9 x 2 crops/flips of its image.
    aug = augmented.train_batch(step, batch)
    np.testing.assert_array_equal(aug["label"], train_labels[expected])
    padded = np.pad(train_images[expected], ((0, 0), (4, 4), (4, 4), (0, 0)))
    kinds = set()
    for row in range(batch):
        matches = [
            (dy, dx, flip)
            for dy in range(9)
            for dx in range(9)
            for flip in (False, True)
            if np.allclose(
                aug["image"][row],
                normalized(
                    padded[row, dy : dy + 32, dx : dx + 32][:, ::-1]
                    if flip
                    else padded[row, dy : dy + 32, dx : dx + 32]
                ),
                atol=1e-6,
            )
        ]
        assert matches, row
        kinds.add(matches[0])
    assert len(kinds) > 4  # crops and flips vary over rows
    assert_batches_equal(aug, augmented.train_batch(step, batch))
    assert not np.array_equal(aug["image"], augmented.train_batch(step + 1, batch)["image"])
    for process_count in (2, 4):
        check_process_split(augmented, step=5, batch=16, process_count=process_count)
    evals = list(plain.eval_batches(24))
    images = np.concatenate([b["image"] for b in evals])
    np.testing.assert_array_equal(np.concatenate([b["mask"] for b in evals]), np.arange(48) < 40)
    np.testing.assert_allclose(images[:40], normalized(test_images), atol=1e-6)
    check_eval_process_split(augmented, batch=24, process_count=2)


# --------------------------------------------------------------------------- SQuAD


VOCAB = [
    *("[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "the", "e", "##iff", "##el", "tower"),
    *("is", "in", "paris", ",", "france", ".", "where", "?", "what", "city", "a", "big"),
    *("river", "runs", "through", "it", "which", "crosses", "seine", "flows"),
]
CONTEXT = "The Eiffel Tower is in Paris, France. A big river runs through it: the Seine."


@pytest.fixture()
def vocab_file(tmp_path):
    path = tmp_path / "vocab.txt"
    path.write_text("\n".join(VOCAB) + "\n", encoding="utf-8")
    return str(path)


def record(question: str, context: str, answers: list[str], index: int, starts=None) -> dict:
    starts = [context.find(a) for a in answers] if starts is None else starts
    return {
        "id": f"q{index}",
        "title": "t",
        "question": question.encode(),  # real tfds data sources return bytes
        "context": context.encode(),
        "answers": {
            "text": np.array([a.encode() for a in answers], dtype=object),
            "answer_start": np.array(starts, dtype=np.int32),
        },
    }


RECORDS = [
    record("Where is the tower?", CONTEXT, ["Paris", "Paris, France"], 0),
    record("Which river runs through it?", CONTEXT, ["the Seine", "Seine"], 1),
    record("What city?", CONTEXT, ["Paris"], 2, starts=[5]),  # wrong offset: dropped in train
    record("What flows?", "A big river flows.", ["A big river"], 3),
]


def test_normalization_f1_and_exact_match_by_hand():
    assert normalize_answer("  The Cat,  sat!  ") == "cat sat"
    assert normalize_answer("An apple a day") == "apple day"
    assert exact_match_score("the Seine.", "Seine") == 1.0
    assert exact_match_score("Paris, France", "Paris") == 0.0
    assert f1_score("Paris, France", "Paris") == pytest.approx(2 / 3)  # p=1/2, r=1
    assert f1_score("a big river", "river runs") == pytest.approx(2 * 0.5 * 0.5 / 1.0)
    assert f1_score("the", "Paris") == 0.0
    assert f1_score("big big river", "big river") == pytest.approx(2 * (2 / 3) * 1 / (5 / 3))


def test_best_spans_against_brute_force():
    rng = np.random.default_rng(1)
    start, end = rng.normal(size=(6, 12)), rng.normal(size=(6, 12))
    valid = rng.random((6, 12)) < 0.7
    valid[5] = False
    scores, starts, ends = best_spans(start, end, valid, max_answer_length=4)
    for row in range(6):
        candidates = [
            (start[row, i] + end[row, j], i, j)
            for i in range(12)
            for j in range(i, min(i + 4, 12))
            if valid[row, i] and valid[row, j]
        ]
        if not candidates:
            assert scores[row] == -np.inf
            continue
        best = max(candidates)
        assert scores[row] == pytest.approx(best[0])
        assert (starts[row], ends[row]) == best[1:]


def test_features_windows_labels_and_offsets(vocab_file):
    tokenizer = WordPieceTokenizer(vocab_file)
    examples = [SquadExample.from_record(r) for r in RECORDS]
    features = build_features(
        examples,
        tokenizer,
        context_length=20,
        doc_stride=4,
        max_query_length=5,
        drop_unanswerable=True,
    )
    assert int(features["num_skipped"]) == 1
    example_index = features["example_index"]
    assert set(example_index) == {0, 1, 3}
    for f in range(len(example_index)):
        example = examples[example_index[f]]
        ids = features["input_ids"][f]
        q_len, seq_len = features["question_length"][f], features["sequence_length"][f]
        assert q_len <= 5 and ids[0] == VOCAB.index("[CLS]") and ids[q_len + 1] == 3
        assert ids[seq_len - 1] == VOCAB.index("[SEP]") and not ids[seq_len:].any()
        offsets = features["context_offsets"][f]
        context_positions = np.flatnonzero(offsets[:, 0] >= 0)
        np.testing.assert_array_equal(context_positions, np.arange(q_len + 2, seq_len - 1))
        for position in context_positions:  # every context token maps back to its text
            piece = example.context[offsets[position, 0] : offsets[position, 1]].lower()
            token = VOCAB[ids[position]]
            assert token == "[UNK]" or piece.endswith(token.removeprefix("##"))
        start, end = features["start_positions"][f], features["end_positions"][f]
        answer_start, answer = example.answer_starts[0], example.answers[0]
        window_start = offsets[context_positions[0], 0]
        window_end = offsets[context_positions[-1], 1]
        if window_start <= answer_start and answer_start + len(answer) <= window_end:
            assert example.context[offsets[start, 0] : offsets[end, 1]] == answer
        else:
            assert start == end == 0
    # Long contexts give several windows whose starts are doc_stride tokens apart.
    windows_of_0 = np.flatnonzero(example_index == 0)
    assert len(windows_of_0) >= 3
    first_context = features["context_offsets"][windows_of_0][:, :, 0]
    starts = [row[row >= 0][0] for row in first_context]
    assert starts == sorted(starts) and starts[0] == 0


@pytest.fixture()
def squad(vocab_file, tmp_path):
    def as_data_source(self, split, **kwargs):
        return RECORDS if split == "train" else RECORDS[:3]

    with mocked_tfds(as_data_source_fn=as_data_source):
        yield get_dataset(
            {
                "name": "squad",
                "vocab_file": vocab_file,
                "context_length": 20,
                "doc_stride": 4,
                "max_query_length": 5,
                "cache_dir": str(tmp_path / "cache"),
            },
            seed=0,
        )


def test_squad_train_batches(squad):
    assert squad.task == "span_qa"
    assert (squad.vocab_size, squad.context_length) == (len(VOCAB), 20)
    assert squad.num_skipped_train_examples == 1 and squad.num_eval_examples == 3
    batch = squad.train_batch(1, 6)
    assert set(batch) == {
        "input_ids",
        "token_type_ids",
        "attention_mask",
        "start_positions",
        "end_positions",
    }
    for key, value in batch.items():
        assert value.dtype == np.int32 and value.shape[0] == 6, key
    expected = reference_indices(0, squad.num_train_examples, 1, 6)
    np.testing.assert_array_equal(batch["input_ids"], squad._train["input_ids"][expected])
    length = squad._train["sequence_length"][expected][:, None]
    q_len = squad._train["question_length"][expected][:, None]
    np.testing.assert_array_equal(batch["attention_mask"], np.arange(20) < length)
    np.testing.assert_array_equal(
        batch["token_type_ids"], (np.arange(20) >= q_len + 2) & (np.arange(20) < length)
    )
    check_process_split(squad, step=2, batch=6, process_count=3)


def oracle_logits(batch: dict, shift: int = 0) -> tuple[np.ndarray, np.ndarray]:
    start = np.full(batch["input_ids"].shape, -10.0)
    end = start.copy()
    rows = np.arange(len(start))
    answerable = batch["start_positions"] > 0
    start[rows[answerable], batch["start_positions"][answerable]] = 5.0
    end[rows[answerable], batch["end_positions"][answerable] + shift] = 5.0
    return start, end


def test_squad_eval_metrics_and_packing(squad):
    batches = list(squad.eval_batches(8))
    seen = np.concatenate([b["example_index"][b["mask"] > 0] for b in batches])
    assert sorted(set(seen)) == [0, 1, 2] and len(seen) == squad.num_eval_features
    for b in batches:  # a question's windows are never split across batches
        assert b["context_offsets"].shape == (8, 20, 2)
        assert np.all(b["example_index"][b["mask"] == 0] == -1)
    for number, b in enumerate(batches):
        for other in batches[number + 1 :]:
            assert not set(b["example_index"][b["mask"] > 0]) & set(other["example_index"])
    totals = {"sum_f1": 0.0, "sum_em": 0.0, "count": 0}
    for b in batches:
        for key, value in squad.squad_metrics(*oracle_logits(b), b).items():
            totals[key] += value
    # Question 2's first answer offset is wrong, so its labels are all [CLS] and its
    # predicted span is the first valid span; the others are predicted exactly.
    _, answers = squad.eval_texts()
    assert answers[2] == ("Paris",)
    predicted_2 = {}
    for b in batches:
        predicted_2.update(squad.predictions(*oracle_logits(b), b))
    assert predicted_2[0] == "Paris" and predicted_2[1] == "the Seine"
    expected_f1 = 2 + f1_score(predicted_2[2], "Paris")
    assert totals["count"] == 3
    assert totals["sum_em"] == pytest.approx(2 + exact_match_score(predicted_2[2], "Paris"))
    assert totals["sum_f1"] == pytest.approx(expected_f1)
    # One token too far: "Paris," and "the Seine." still match after normalization.
    shifted = {}
    for b in batches:
        shifted.update(squad.predictions(*oracle_logits(b, shift=1), b))
    assert shifted[0] == "Paris," and shifted[1] == "the Seine."
    shifted_em = sum(squad.squad_metrics(*oracle_logits(b, shift=1), b)["sum_em"] for b in batches)
    assert shifted_em == pytest.approx(2 + exact_match_score(shifted[2], "Paris"))


def test_squad_metrics_do_not_depend_on_process_count(squad):
    def total(process_count):
        sums = np.zeros(3)
        for process in range(process_count):
            for b in squad.eval_batches(12, process, process_count):
                m = squad.squad_metrics(*oracle_logits(b), b)
                sums += [m["sum_f1"], m["sum_em"], m["count"]]
        return sums

    np.testing.assert_allclose(total(1), total(2))
    np.testing.assert_allclose(total(1), total(3))
    with pytest.raises(ValueError, match="evaluation global batch size of at least"):
        list(squad.eval_batches(2))


def test_squad_partial_span_f1_by_hand(squad):
    batch = next(squad.eval_batches(8))
    row = int(np.flatnonzero((batch["example_index"] == 0) & (batch["start_positions"] > 0))[0])
    start = np.full(batch["input_ids"].shape, -10.0)
    end = start.copy()
    s = batch["start_positions"][row]
    start[row, s] = 3.0
    end[row, s + 2] = 3.0  # "Paris, France"
    predicted = squad.predictions(start, end, batch)
    assert predicted[0] == "Paris, France"
    metrics = squad.squad_metrics(start, end, batch)
    f1_others = sum(
        max(f1_score(predicted[e], g) for g in squad.eval_texts()[1][e]) for e in predicted if e
    )
    assert metrics["sum_f1"] == pytest.approx(1.0 + f1_others)  # gold "Paris, France" matches


def test_squad_missing_vocab_says_where_to_get_it(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"bert-base-uncased/resolve/main/vocab.txt"):
        get_dataset({"name": "squad", "vocab_file": str(tmp_path / "vocab.txt")}, seed=0)


def test_squad_not_prepared_says_how_to_build(vocab_file, tmp_path):
    with pytest.raises(FileNotFoundError, match=r"tfds build squad/v1.1 --data_dir="):
        get_dataset(
            {"name": "squad", "vocab_file": vocab_file, "data_dir": str(tmp_path / "tfds")},
            seed=0,
        )
