"""Text corpora on tiny files in each naming, their vocabulary and batches, and the embedded pydoc corpus."""

import platform
import re
import sys

import pytest
import torch
from omegaconf import OmegaConf

from qtrain.config import validate
from qtrain.data import DATASETS, load_data
from qtrain.data.embedded_text import cache_dir
from qtrain.data.text import TokenStream, find_corpus, read_corpus
from qtrain.errors import ConfigError, DataError
from qtrain.task import LANGUAGE_MODEL

from .conftest import make_config

TRAIN, VALID, TEST = "the cat sat\n\nthe dog", "a cat\n", "the bird sat\n"  # the training file lacks its last newline


def _write(root, naming, train=TRAIN, valid=VALID, test=TEST, newline=None):
    for split, text in (("train", train), ("valid", valid), ("test", test)):
        (root / naming.format(split)).write_text(text, encoding="utf-8", newline=newline)


@pytest.mark.parametrize("naming", ["wiki.{}.tokens", "{}.txt", "ptb.{}.txt"])
def test_each_naming_loads_with_the_training_vocabulary(tmp_path, naming):
    _write(tmp_path, naming)
    data = read_corpus(tmp_path, "corpus")
    assert data.vocab == ("<unk>", "<eos>", "the", "cat", "sat", "dog")
    assert data.train.tolist() == [2, 3, 4, 1, 1, 2, 5, 1]  # the empty line is a lone <eos>, the last line ends in one
    assert data.valid.tolist() == [0, 3, 1]  # "a" is not a training word
    assert data.test.tolist() == [2, 0, 4, 1]  # nor is "bird"
    assert data.train.dtype == torch.int64 and data.model_inputs() == {"vocab_size": 6}
    assert data.task is LANGUAGE_MODEL and DATASETS["wikitext2"] is LANGUAGE_MODEL


def test_wikitext_unk_tokens_are_the_unk_id_and_crlf_files_read_as_lines(tmp_path):
    _write(tmp_path, "wiki.{}.tokens", train=" = Title = \r\n<unk> runs\r\n", valid="runs\r\n", test="= runs\r\n",
           newline="")
    data = read_corpus(tmp_path, "wikitext2")
    assert data.vocab == ("<unk>", "<eos>", "=", "Title", "runs")
    assert data.train.tolist() == [2, 3, 2, 1, 0, 4, 1]
    chars = read_corpus(tmp_path, "wikitext2", level="char")
    assert "\r" not in chars.vocab and chars.vocab[:5] == ("<unk>", "<eos>", " ", "=", "T")


def test_character_level_makes_every_character_a_token(tmp_path):
    _write(tmp_path, "{}.txt", train="ab a\n\nb\n", valid="c\n", test="ba\n")
    data = read_corpus(tmp_path, "corpus", level="char")
    assert data.vocab == ("<unk>", "<eos>", "a", "b", " ")
    assert data.train.tolist() == [2, 3, 4, 2, 1, 1, 3, 1]
    assert (data.valid.tolist(), data.test.tolist()) == ([0, 1], [3, 2, 1])


def test_min_count_folds_rare_training_words_into_unk(tmp_path):
    _write(tmp_path, "{}.txt", train="a b a c a b\n", valid="c b\n", test="a\n")
    twice = read_corpus(tmp_path, "corpus", min_count=2)
    assert twice.vocab == ("<unk>", "<eos>", "a", "b")  # <eos> stays though it occurs once
    assert twice.train.tolist() == [2, 3, 2, 0, 2, 3, 1] and twice.valid.tolist() == [0, 3, 1]
    thrice = read_corpus(tmp_path, "corpus", min_count=3)
    assert thrice.vocab == ("<unk>", "<eos>", "a") and thrice.train.tolist() == [2, 0, 2, 0, 2, 0, 1]


def test_sample_keeps_the_first_tokens_and_the_whole_vocabulary(tmp_path):
    _write(tmp_path, "{}.txt")
    data = load_data(make_config("data=corpus", f"data.root={tmp_path}", "data.sample={train: 3, test: 2}").data)
    assert (data.train.tolist(), data.test.tolist(), data.valid.tolist()) == ([2, 3, 4], [2, 0], [0, 3, 1])
    assert len(data.vocab) == 6
    whole = load_data(make_config("data=corpus", f"data.root={tmp_path}").data)
    test_only = load_data(make_config("data=corpus", f"data.root={tmp_path}", "data.sample={test: 2}").data)
    assert test_only.train.tolist() == whole.train.tolist() and test_only.test.tolist() == [2, 0]  # train left whole


def test_batches_are_rows_of_running_text_with_targets_shifted_by_one():
    stream = TokenStream(torch.arange(100, 123), rows=2, seq_len=4)  # 2 rows of 11 tokens; token 122 is dropped
    batches = [(x.tolist(), y.tolist()) for x, y in stream.epoch(0)]
    assert batches == [
        ([[100, 101, 102, 103], [111, 112, 113, 114]], [[101, 102, 103, 104], [112, 113, 114, 115]]),
        ([[104, 105, 106, 107], [115, 116, 117, 118]], [[105, 106, 107, 108], [116, 117, 118, 119]]),
        ([[108, 109], [119, 120]], [[109, 110], [120, 121]]),  # the last batch is shorter
    ]
    assert len(stream) == 3 and stream.samples == 6 and stream.global_size(2) == 2
    assert [(x.tolist(), y.tolist()) for x, y in stream.epoch(5)] == batches  # the same batches every epoch
    assert stream.example(3).tolist() == [[100, 101, 102, 103], [104, 105, 106, 107], [108, 109, 110, 111]]
    assert TokenStream(torch.arange(5), rows=1, seq_len=4).example(2).tolist() == [[0, 1, 2, 3], [4, 0, 1, 2]]


def test_training_batches_are_whole_sequences_in_an_order_drawn_per_epoch():
    stream = TokenStream(torch.arange(100, 123), rows=2, seq_len=4, whole_batches=True)
    assert [x.tolist() for x, _ in stream.epoch(0)] == [[[100, 101, 102, 103], [111, 112, 113, 114]],
                                                         [[104, 105, 106, 107], [115, 116, 117, 118]]]
    assert len(stream) == 2 and stream.samples == 4
    shuffled = TokenStream(torch.arange(1000), rows=2, seq_len=4, whole_batches=True, seed=7)
    firsts = {e: [x[0, 0].item() for x, _ in shuffled.epoch(e)] for e in range(3)}
    assert sorted(firsts[0]) == list(range(0, 496, 4))  # every whole sequence of the first row, once
    assert firsts[0] != firsts[1] != firsts[2] and firsts[1] == [x[0, 0].item() for x, _ in shuffled.epoch(1)]
    assert [x[0, 0].item() for x, _ in shuffled.epoch(1, start=5)] == firsts[1][5:]
    with pytest.raises(DataError, match=r"holds 9 tokens, too few for 2 rows of at least 5 tokens \(lower "
                                        r"train.batch_size or model.seq_len\)$"):
        TokenStream(torch.arange(9), rows=2, seq_len=4, whole_batches=True)


def test_rank_slices_cover_each_global_batch_exactly():
    tokens = torch.arange(61)
    whole = list(TokenStream(tokens, rows=5, seq_len=3).epoch(0))
    ranks = [TokenStream(tokens, rows=5, seq_len=3, rank=r, world=3) for r in range(3)]
    assert [len(r.part) for r in ranks] == [1, 2, 2] and ranks[0].smallest_part() == 1
    for i, parts in enumerate(zip(*(r.epoch(0) for r in ranks))):
        assert torch.equal(torch.cat([x for x, _ in parts]), whole[i][0])
        assert torch.equal(torch.cat([y for _, y in parts]), whole[i][1])
        assert all(r.global_size(i) == 5 for r in ranks)
    assert i == len(whole) - 1 == 3  # 12 tokens a row: 11 input columns, in batches of 3


def test_streams_take_the_batch_sizes_and_context_length_of_the_run(tmp_path):
    _write(tmp_path, "{}.txt", train="a b c d e f g h i j\n", test="a b c d e\n")
    data = read_corpus(tmp_path, "corpus")
    cfg = OmegaConf.create({"train": {"batch_size": 2, "eval_batch_size": 3}, "model": {"seq_len": 3}, "seed": 0})
    train, test = data.streams(cfg, torch.device("cpu"), 0, 1)
    assert [x.shape for x, _ in train.epoch(0)] == [(2, 3)]  # 2 rows of 11 // 2 = 5 tokens: one whole sequence of 3
    assert [x.tolist() for x, _ in test.epoch(0)] == [[[2], [4], [6]]]  # 6 test tokens: 3 rows of 2
    cfg.train.batch_size = 6
    with pytest.raises(DataError, match=r"^the training split of corpus holds 11 tokens, too few for 6 rows of at least 4 "
                                        r"tokens \(lower train.batch_size or model.seq_len\)$"):
        data.streams(cfg, torch.device("cpu"), 0, 1)
    cfg.train.batch_size, cfg.train.eval_batch_size = 2, 4
    with pytest.raises(DataError, match=r"test split of corpus holds 6 tokens, .* \(lower train.eval_batch_size\)$"):
        data.streams(cfg, torch.device("cpu"), 0, 1)


def test_missing_partial_and_doubled_namings_are_one_line_errors(tmp_path):
    looked = r"looked for wiki.\{train,valid,test\}.tokens, \{train,valid,test\}.txt, <name>.\{train,valid,test\}.txt"
    with pytest.raises(DataError, match=rf"^no corpus under {tmp_path}: {looked}$"):
        find_corpus(tmp_path)
    (tmp_path / "wiki.train.tokens").write_text("a\n")
    with pytest.raises(DataError, match=rf"{looked} \(wiki.valid.tokens, wiki.test.tokens missing\)$"):
        find_corpus(tmp_path)
    _write(tmp_path, "{}.txt")
    _write(tmp_path, "ptb.{}.txt")
    with pytest.raises(DataError, match=r"^two corpora under .*: \{train,valid,test\}.txt and ptb.\{train,valid,test\}.txt "):
        find_corpus(tmp_path)


def test_a_file_that_is_not_utf8_is_a_data_error(tmp_path):
    _write(tmp_path, "{}.txt")
    (tmp_path / "test.txt").write_bytes(b"caf\xe9\n")  # Latin-1
    with pytest.raises(DataError, match=r"test.txt is not UTF-8 text: invalid continuation byte$"):
        read_corpus(tmp_path, "corpus")


@pytest.mark.parametrize("override,message", [
    ("data.level=byte", "data.level='byte' is not allowed (choose from: word, char)"),
    ("data.min_count=0", "data.min_count=0 is not allowed: it must be an integer >= 1"),
    ("data.sample={train: 0, test: 5}", "data.sample={'train': 0, 'test': 5} is not allowed"),
])
@pytest.mark.parametrize("dataset", ["wikitext2", "text"])
def test_bad_text_options_are_refused_before_any_work(tmp_path, dataset, override, message):
    cfg = make_config(f"data={dataset}", override, *([f"data.root={tmp_path}"] if dataset != "text" else []))
    with pytest.raises(ConfigError) as err:
        validate(cfg)
    assert str(err.value).startswith(message)


@pytest.mark.slow
def test_file_corpora_need_their_root_and_smoke_scale_stands_in_the_embedded_text(tmp_path, monkeypatch):
    for name in ("wikitext2", "wikitext103", "corpus"):
        with pytest.raises(ConfigError, match=f"data.root is not set: .* the {name} files"):
            validate(make_config(f"data={name}"))
    validate(make_config("data=wikitext103", f"data.root={tmp_path}"))
    monkeypatch.setenv("QTRAIN_CACHE", str(tmp_path))
    cfg = make_config("data=wikitext2", "scale=smoke")
    validate(cfg)  # no root needed
    assert (cfg.data.name, cfg.data.stand_in_for, cfg.data.level) == ("text", "wikitext2", "word")
    data = load_data(cfg.data)
    assert (len(data.train), len(data.test)) == (2048, 640)


def _squashed(lines):
    return ["".join(line.split()) for line in lines]


def test_embedded_corpus_is_pythons_documentation_split_by_topic_and_cached(tmp_path, monkeypatch):
    from pydoc_data.topics import topics

    monkeypatch.setenv("QTRAIN_CACHE", str(tmp_path))
    data = load_data(make_config("data=text").data)
    folder = next((tmp_path / "text").iterdir())
    assert folder.name == f"python-{platform.python_version()}"
    files = {split: (folder / f"pydoc.{split}.txt").read_text(encoding="utf-8").splitlines()
             for split in ("train", "valid", "test")}
    # every topic, in sorted order, lies whole in one split; tokenizing changed only the whitespace
    at = dict.fromkeys(files, 0)
    for key in sorted(topics):
        lines = _squashed(topics[key].splitlines())
        homes = [s for s in files if _squashed(files[s][at[s]:at[s] + len(lines)]) == lines]
        assert homes, key
        at[homes[0]] += len(lines)
    assert at == {split: len(lines) for split, lines in files.items()}
    tokens = [token for lines in files.values() for line in lines for token in line.split()]
    assert all(re.fullmatch(r"\w+|[^\w\s]", token) for token in tokens)  # words and punctuation apart
    shares = {split: sum(len(line.split()) + 1 for line in lines) / (len(tokens) + sum(map(len, files.values())))
              for split, lines in files.items()}
    assert 0.85 < shares["train"] < 0.95 and 0.02 < shares["valid"] < 0.08 and 0.02 < shares["test"] < 0.08
    assert data.vocab[:2] == ("<unk>", "<eos>") and 1000 < len(data.vocab) < 5000  # min_count 3 keeps it modest
    assert len(data.train) == sum(len(line.split()) + 1 for line in files["train"])

    (folder / "pydoc.test.txt").write_text("the the\n")  # a second load reads the cache and builds nothing
    monkeypatch.setattr("qtrain.data.embedded_text.split_topics", lambda topics: pytest.fail("rebuilt"))
    again = load_data(make_config("data=text").data)
    assert again.test.tolist() == [data.vocab.index("the")] * 2 + [1] and torch.equal(again.train, data.train)


@pytest.mark.slow
def test_embedded_corpus_is_rebuilt_where_incomplete_and_errors_are_one_line(tmp_path, monkeypatch):
    monkeypatch.setenv("QTRAIN_CACHE", str(tmp_path))
    folder = cache_dir() / f"python-{platform.python_version()}"
    folder.mkdir(parents=True)
    (folder / "pydoc.train.txt").write_text("partial\n")
    monkeypatch.setitem(sys.modules, "pydoc_data.topics", None)  # a Python without pydoc_data
    with pytest.raises(DataError, match=r"^data=text needs the standard library's pydoc_data, which Python .* lacks"):
        load_data(make_config("data=text").data)
    monkeypatch.undo()
    (tmp_path / "a_file").write_text("")
    monkeypatch.setenv("QTRAIN_CACHE", str(tmp_path / "a_file"))
    with pytest.raises(DataError, match=r"^cannot write the embedded text corpus to .*a_file/text/python-.*: Not a "
                                        r"directory \(set QTRAIN_CACHE to a writable folder\)$"):
        load_data(make_config("data=text").data)
    monkeypatch.setenv("QTRAIN_CACHE", str(tmp_path))
    assert len(load_data(make_config("data=text").data).train) > 50_000  # the partial file was replaced


def test_cache_folder_follows_qtrain_cache_then_xdg_then_home(tmp_path, monkeypatch):
    monkeypatch.setenv("QTRAIN_CACHE", str(tmp_path / "q"))
    assert cache_dir() == tmp_path / "q" / "text"
    monkeypatch.delenv("QTRAIN_CACHE")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "x"))
    assert cache_dir() == tmp_path / "x" / "qtrain" / "text"
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "h"))
    assert cache_dir() == tmp_path / "h" / ".cache" / "qtrain" / "text"


def test_wikitext_root_is_the_release_folder_or_its_parent(tmp_path):
    release = tmp_path / "wikitext-2"
    release.mkdir()
    _write(release, "wiki.{}.tokens")
    parent = load_data(make_config("data=wikitext2", f"data.root={tmp_path}").data)
    itself = load_data(make_config("data=wikitext2", f"data.root={release}").data)
    assert parent.train.tolist() == itself.train.tolist() == [2, 3, 4, 1, 1, 2, 5, 1]
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(DataError, match=rf"^no corpus under {empty}: .* \(nor a wikitext-2/ folder holding one\)$"):
        load_data(make_config("data=wikitext2", f"data.root={empty}").data)
