"""Data pipeline: llm.c token shards (valid and malformed), the text and standard-library corpora with
their cached tokenizer, the train/validation split and the deterministic, resumable batch loader."""

import hashlib
import json
import logging
import os
import re
import sys
import sysconfig

import numpy as np
import pytest
import torch
from omegaconf import OmegaConf

from tritonllm.data import TokenLoader, TokenStream, Tokenizer, load_corpus, open_shard, write_shard
from tritonllm.data.corpus import (content_sha256, file_sha256, python_sources, read_manifest, stdlib_files,
                                   within_budget)
from tritonllm.data.shards import HEADER_BYTES
from tritonllm.errors import ConfigError, DataError

TEXT = [
    "def add(a, b):\n    return a + b\n\n\nclass Point:\n    def __init__(self, x, y):\n        self.x = x\n",
    "The quick brown fox jumps over the lazy dog.\nPack my box with five dozen liquor jugs.\n\tTabbed line.\n",
    "for i in range(10):\n    print(i * i)  # squares\nwhile True:\n    break\n",
]


def text_files(folder, n=12):
    folder.mkdir(exist_ok=True)
    for i in range(n):
        (folder / f"doc{i:02d}.txt").write_text(TEXT[i % len(TEXT)] * (3 + i % 4) + f"document number {i}\n")
    return str(folder / "*.txt")


def data_cfg(**kw):
    return OmegaConf.create(kw)


# ----------------------------------------------------------------------------- shards

@pytest.mark.parametrize("vocab,magic,itemsize", [(50257, 20240520, 2), (128256, 20240801, 4)],
                         ids=["gpt2-uint16", "llama3-uint32"])
def test_shard_roundtrip(tmp_path, vocab, magic, itemsize):
    ids = np.random.default_rng(0).integers(0, vocab, size=1001)
    path = str(tmp_path / "s.bin")
    write_shard(path, ids, vocab)
    header = np.fromfile(path, dtype="<i4", count=3)
    assert header.tolist() == [magic, 1 if magic == 20240520 else 7, 1001]
    assert os.path.getsize(path) == HEADER_BYTES + 1001 * itemsize
    tokens = open_shard(path)
    assert isinstance(tokens, np.memmap) and tokens.dtype.itemsize == itemsize
    np.testing.assert_array_equal(tokens, ids)


def _raw_shard(path, magic, version, count, n_tokens, dtype="<u2"):
    header = np.zeros(256, dtype="<i4")
    header[:3] = (magic, version, count)
    with open(path, "wb") as f:
        f.write(header.tobytes() + np.arange(n_tokens, dtype=dtype).tobytes())
    return str(path)


@pytest.mark.parametrize("magic,version,count,n_tokens,match", [
    (12345, 1, 10, 10, "magic 12345; expected 20240520 or 20240801"),
    (20240520, 7, 10, 10, "version 7; magic 20240520 expects version 1"),
    (20240801, 1, 10, 10, "version 1; magic 20240801 expects version 7"),
    (20240520, 1, 100, 60, "header says 100 tokens"),
    (20240520, 1, 10, 12, "header says 10 tokens"),
], ids=["wrong-magic", "wrong-version-gpt2", "wrong-version-llama3", "truncated", "trailing-bytes"])
def test_malformed_shard_rejected_with_file_name(tmp_path, magic, version, count, n_tokens, match):
    dtype = "<u4" if magic == 20240801 else "<u2"
    path = _raw_shard(tmp_path / "bad_shard.bin", magic, version, count, n_tokens, dtype)
    with pytest.raises(DataError, match="bad_shard.bin") as e:
        open_shard(path)
    assert match in str(e.value)


def test_shard_shorter_than_header(tmp_path):
    path = tmp_path / "tiny.bin"
    path.write_bytes(b"\0" * 100)
    with pytest.raises(DataError, match="tiny.bin.*shorter than the 1024-byte header"):
        open_shard(str(path))


# ----------------------------------------------------------------------------- loader

def test_stream_reads_across_shard_boundaries():
    shards = [np.arange(0, 5), np.arange(5, 6), np.arange(6, 20)]
    s = TokenStream(shards, 3, 18)
    assert len(s) == 15
    np.testing.assert_array_equal(s.read(0, 15), np.arange(3, 18))
    np.testing.assert_array_equal(s.read(1, 4), [4, 5, 6, 7])


def _loader(n_tokens=1000, seed=0, batch=4, seq=16, shuffle=True, vocab=None):
    return TokenLoader(TokenStream([np.arange(n_tokens) % 997]), batch, seq, seed, shuffle, vocab)


def test_batches_are_shifted_windows_and_cover_an_epoch_once(caplog):
    loader = _loader(n_tokens=16 * 20 + 1, batch=5)
    firsts = []
    for _ in range(4):  # 20 windows = 4 batches of 5: one epoch
        x, y = loader.next_batch()
        assert x.shape == y.shape == (5, 16) and x.dtype == torch.int64
        assert torch.equal(x[:, 1:], y[:, :-1])
        firsts += (x[:, 0] // 16).tolist()
    assert sorted(firsts) == list(range(20))
    assert loader.state_dict()["epoch"] == 0 and loader.epoch_tokens == 20 * 16
    with caplog.at_level(logging.INFO, logger="tritonllm.data.loader"):
        loader.next_batch()
    assert loader.state_dict()["epoch"] == 1
    assert caplog.messages == ["data: epoch 2 begins: the training data repeats (320 tokens)"]
    with caplog.at_level(logging.INFO, logger="tritonllm.data.loader"):
        for _ in range(3):  # the rest of epoch 2: no other line
            loader.next_batch()
    assert len(caplog.messages) == 1


def test_loader_deterministic_given_seed_and_resumable():
    a, b, c = _loader(seed=1), _loader(seed=1), _loader(seed=2)
    batches_a = [a.next_batch()[0] for _ in range(3)]
    assert all(torch.equal(p, b.next_batch()[0]) for p in batches_a)
    assert not torch.equal(batches_a[0], c.next_batch()[0])
    state = a.state_dict()
    expected = [a.next_batch()[0] for _ in range(20)]  # crosses into the next epochs
    resumed = _loader(seed=1)
    resumed.load_state_dict(state)
    assert all(torch.equal(e, resumed.next_batch()[0]) for e in expected)


def test_loader_rejects_state_of_other_data():
    state = _loader(n_tokens=1000).state_dict()
    with pytest.raises(DataError, match="windows"):
        _loader(n_tokens=2000).load_state_dict(state)


def test_validation_batches_fixed_and_stateless():
    val = _loader(shuffle=False)
    first = [x for x, _ in val.batches(3)]
    again = [x for x, _ in val.batches(3)]
    assert all(torch.equal(p, q) for p, q in zip(first, again))
    assert first[0][0, 0].item() == 0 and val.state_dict()["index"] == 0


def test_split_too_small_is_clear():
    with pytest.raises(DataError, match="fewer than seq_len"):
        _loader(n_tokens=10, seq=16)


def test_token_outside_vocab_is_a_data_error():
    loader = _loader(vocab=100)
    with pytest.raises(DataError, match="token id .* outside the model's vocabulary of 100"):
        loader.next_batch()


# ----------------------------------------------------------------------------- corpora

def test_bin_corpus_with_val_files_and_split(tmp_path):
    for i in range(2):
        write_shard(str(tmp_path / f"train_{i}.bin"), np.arange(i * 300, i * 300 + 300) % 50000, 50257)
    write_shard(str(tmp_path / "val_0.bin"), np.arange(200), 50257)
    corpus = load_corpus(data_cfg(kind="bin", files=str(tmp_path / "train_*.bin"),
                                  val_files=str(tmp_path / "val_*.bin"), val_fraction=0.1, vocab_size=50257))
    assert corpus.vocab_size == 50257 and corpus.tokenizer is None
    train, val = corpus.loaders(2, 8, 0, 50257)
    assert train.n_windows == (600 - 1) // 8 and val.n_windows == (200 - 1) // 8
    split = load_corpus(data_cfg(kind="bin", files=str(tmp_path / "train_*.bin"), val_files=None,
                                 val_fraction=0.25, vocab_size=None))
    train, val = split.loaders(2, 8, 0, None)
    assert len(train.stream) == 450 and len(val.stream) == 150
    assert next(val.batches(1))[0][0, 0].item() == 450


def test_bin_malformed_shard_named_through_corpus(tmp_path):
    write_shard(str(tmp_path / "a.bin"), np.arange(100), 50257)
    _raw_shard(tmp_path / "b.bin", 20240520, 1, 500, 10)
    with pytest.raises(DataError, match="b.bin"):
        load_corpus(data_cfg(kind="bin", files=str(tmp_path / "*.bin"), val_files=None, val_fraction=0.1))


@pytest.mark.parametrize("kind,key", [("bin", "data.files"), ("text", "data.files")], ids=["bin", "text"])
def test_missing_data_path(tmp_path, kind, key):
    with pytest.raises(DataError, match=f"{key}=.*nothing_here.*matches no file"):
        load_corpus(data_cfg(kind=kind, files=str(tmp_path / "nothing_here" / "*.bin"), val_files=None,
                             vocab_size=400, cache_dir=str(tmp_path / "cache")))


def test_missing_tokenizer_path(tmp_path):
    with pytest.raises(DataError, match="data.tokenizer=.*no.model"):
        load_corpus(data_cfg(kind="text", files=text_files(tmp_path / "t"), tokenizer=str(tmp_path / "no.model"),
                             vocab_size=400, cache_dir=str(tmp_path / "cache")))


def test_unknown_kind():
    with pytest.raises(ConfigError, match="data.kind='csv'"):
        load_corpus(data_cfg(kind="csv"))


def test_text_corpus_trains_tokenizer_caches_and_roundtrips(tmp_path, monkeypatch):
    cfg = data_cfg(kind="text", files=text_files(tmp_path / "texts"), tokenizer=None, vocab_size=400,
                   max_bytes=None, tokenizer_bytes=None, val_fraction=0.1, cache_dir=str(tmp_path / "cache"))
    corpus = load_corpus(cfg)
    tok = corpus.tokenizer
    assert corpus.vocab_size == tok.vocab_size <= 400
    for text in TEXT:
        assert tok.decode(tok.encode(text)) == text
    tokens = np.asarray(corpus.train_shards[0])
    assert (tokens == tok.eos_id).sum() == 12  # one end-of-document token per file
    # the same settings hit the cache: no retraining
    monkeypatch.setattr(Tokenizer, "train", staticmethod(lambda *a, **k: pytest.fail("retrained")))
    again = load_corpus(cfg)
    np.testing.assert_array_equal(np.asarray(again.train_shards[0]), tokens)
    # a given tokenizer is used as is
    given = load_corpus(data_cfg(**{**OmegaConf.to_container(cfg), "files": str(tmp_path / "texts" / "doc0*.txt"),
                                    "tokenizer": tok.path}))
    assert given.vocab_size == tok.vocab_size
    assert len(given.train_shards[0]) < len(tokens)


def test_stdlib_corpus(tmp_path):
    files = stdlib_files()
    assert files == sorted(files) and files
    assert not any("site-packages" in f for f in files)
    cfg = data_cfg(kind="stdlib", max_bytes=150_000, vocab_size=400, tokenizer_bytes=None, val_fraction=0.05,
                   cache_dir=str(tmp_path / "cache"))
    corpus = load_corpus(cfg)
    assert corpus.tokenizer is not None and corpus.vocab_size <= 400
    train, val = corpus.loaders(2, 32, 0, corpus.vocab_size)
    x, _ = train.next_batch()
    assert x.max().item() < corpus.vocab_size
    assert len(os.listdir(tmp_path / "cache")) == 1
    used = within_budget(files, 150_000)
    identity = corpus.identity
    assert identity["name"] == f"stdlib (manifest of Python {read_manifest()['python']})"
    assert identity["files"] == len(used) and identity["sha256"] == content_sha256([_sha(f) for f in used])
    assert identity["train_tokens"] + identity["val_tokens"] == len(corpus.train_shards[0]) == len(train.stream) + len(
        val.stream)
    # a second build, from scratch in another cache, is the same corpus
    again = load_corpus(data_cfg(**{**OmegaConf.to_container(cfg), "cache_dir": str(tmp_path / "other")}))
    assert again.identity == identity
    np.testing.assert_array_equal(np.asarray(again.train_shards[0]), np.asarray(corpus.train_shards[0]))


def _sha(path):
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


def test_the_checked_in_manifest_defines_the_embedded_corpus():
    """stdlib_manifest.json: relative paths in sorted order, once each, with a sha256 each; this
    machine's corpus is the manifest's files it holds unchanged, in the manifest's order."""
    spec = read_manifest()
    assert spec["python"].startswith("3.11.")
    paths = [p for p, _ in spec["files"]]
    assert paths == sorted(paths) and len(set(paths)) == len(paths) > 1000
    assert "os.py" in paths and not any(p.startswith("/") or "site-packages" in p for p in paths)
    assert all(re.fullmatch("[0-9a-f]{64}", sha) for _, sha in spec["files"])
    root = sysconfig.get_paths()["stdlib"]
    files = stdlib_files()
    expected = {p: sha for p, sha in spec["files"]}
    rel = [os.path.relpath(f, root).replace(os.sep, "/") for f in files]
    assert rel == [p for p in paths if p in set(rel)]
    assert all(_sha(f) == expected[r] for f, r in list(zip(files, rel))[::97])
    if sys.version.split()[0] == spec["python"] and len(files) == len(paths):  # the Python it was written from
        assert [os.path.relpath(f, root).replace(os.sep, "/") for f in python_sources(root)] == paths


def fake_stdlib(monkeypatch, tmp_path, texts: dict) -> str:
    """A standard library of ``texts`` ({relative path: text}) in tmp_path/lib and a manifest of it,
    both in use; returns the library folder."""
    from tritonllm.data import corpus as corpus_module

    lib = tmp_path / "lib" / "python3"
    rows = []
    for rel, text in texts.items():
        (lib / rel).parent.mkdir(parents=True, exist_ok=True)
        (lib / rel).write_text(text)
        rows.append([rel, _sha(lib / rel)])
    (tmp_path / "manifest.json").write_text(json.dumps({"python": "3.11.0", "files": rows}))
    paths = {**sysconfig.get_paths(), "stdlib": str(lib)}
    monkeypatch.setattr(sysconfig, "get_paths", lambda: paths)
    monkeypatch.setattr(corpus_module, "MANIFEST", str(tmp_path / "manifest.json"))
    return str(lib)


def test_manifest_files_missing_or_changed_are_left_out_with_one_line(monkeypatch, tmp_path, caplog):
    """A machine lacking some of the manifest's files, or holding them with other bytes, builds the
    corpus from the rest, says so in one line, and its corpus hash differs from the full one."""
    texts = {f"mod{i}.py": f"def f{i}(x):\n    return x * {i}\n" * 40 for i in range(4)}
    lib = fake_stdlib(monkeypatch, tmp_path, texts)
    cfg = data_cfg(kind="stdlib", max_bytes=None, vocab_size=300, tokenizer_bytes=None, val_fraction=0.1,
                   cache_dir=str(tmp_path / "cache"))
    with caplog.at_level(logging.INFO, logger="tritonllm.data.corpus"):
        full = load_corpus(cfg).identity
    assert full["files"] == 4 and full["name"] == "stdlib (manifest of Python 3.11.0)"
    assert not [m for m in caplog.messages if "the manifest's" in m]
    os.remove(os.path.join(lib, "mod1.py"))
    with open(os.path.join(lib, "mod3.py"), "a") as f:
        f.write("# changed\n")
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="tritonllm.data.corpus"):
        part = load_corpus(cfg).identity
    lines = [m for m in caplog.messages if "the manifest's" in m]
    assert len(lines) == 1 and "of the manifest's 4 files (Python 3.11.0), 1 are missing and 1 differ" in lines[0]
    assert "reads the other 2" in lines[0]
    assert part["files"] == 2 and part["sha256"] != full["sha256"] and part["train_tokens"] < full["train_tokens"]
    assert part["sha256"] == content_sha256([_sha(os.path.join(lib, f)) for f in ("mod0.py", "mod2.py")])
    for name in ("mod0.py", "mod2.py", "mod3.py"):
        os.remove(os.path.join(lib, name))
    with pytest.raises(DataError, match="none of the standard-library manifest's files"):
        load_corpus(cfg)


def test_text_and_bin_corpora_carry_their_identity(tmp_path):
    """data=text and data=bin name the files read, their tokens and the hash of their bytes, the same
    on a rebuild; a changed file changes the hash."""
    pattern = text_files(tmp_path / "texts", n=6)
    cfg = data_cfg(kind="text", files=pattern, tokenizer=None, vocab_size=400, max_bytes=None, tokenizer_bytes=None,
                   val_fraction=0.1, cache_dir=str(tmp_path / "cache"))
    text = load_corpus(cfg).identity
    files = sorted((tmp_path / "texts").glob("*.txt"))
    assert text["name"] == f"text {pattern}" and text["files"] == 6
    assert text["sha256"] == content_sha256([_sha(f) for f in files])
    assert load_corpus(cfg).identity == text
    shards = []
    for i, n in enumerate((300, 500)):
        shards.append(tmp_path / f"train_{i}.bin")
        write_shard(str(shards[-1]), np.arange(n) % 1000, 50257)
    write_shard(str(tmp_path / "val_0.bin"), np.arange(200), 50257)
    bcfg = data_cfg(kind="bin", files=str(tmp_path / "train_*.bin"), val_files=str(tmp_path / "val_*.bin"),
                    val_fraction=0.1, vocab_size=50257, cache_dir=str(tmp_path / "cache"))
    shards.append(tmp_path / "val_0.bin")
    before = load_corpus(bcfg).identity
    assert before == {"name": f"bin {tmp_path / 'train_*.bin'} + {tmp_path / 'val_*.bin'}", "files": 3,
                      "train_tokens": 800, "val_tokens": 200, "sha256": content_sha256([_sha(f) for f in shards])}
    write_shard(str(shards[0]), np.arange(300) + 1, 50257)
    after = load_corpus(bcfg).identity["sha256"]
    assert after != before["sha256"] and after == content_sha256([_sha(f) for f in shards])


def test_large_files_hash_once(tmp_path, monkeypatch):
    """A file of HASH_CACHE_BYTES or more (a token shard) is hashed once: its sha256 is cached under
    its path, size and modification time; a missing file is a DataError naming it."""
    from tritonllm.data import corpus as corpus_module

    path = tmp_path / "shard.bin"
    path.write_bytes(b"a" * 1000)
    monkeypatch.setattr(corpus_module, "HASH_CACHE_BYTES", 1000)
    first = file_sha256(str(path), str(tmp_path / "cache"))
    assert first == _sha(path) and len(os.listdir(tmp_path / "cache" / "sha256")) == 1
    st = os.stat(path)
    path.write_bytes(b"b" * 1000)
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert file_sha256(str(path), str(tmp_path / "cache")) == first  # read from the cache
    assert file_sha256(str(path)) == _sha(path) != first
    with pytest.raises(DataError, match="cannot read .*gone.bin"):
        file_sha256(str(tmp_path / "gone.bin"))


def test_python_corpus_with_the_installed_packages(monkeypatch, tmp_path):
    """``packages``: the manifest's standard-library files first, then every installed package's ``*.py`` once
    (sysconfig's purelib, a site-packages folder or a --target folder on sys.path; the same folder
    twice or through a link adds nothing), files that are not text left out."""
    pytest.importorskip("sentencepiece")  # imported now: sys.path is replaced below
    lib = tmp_path / "lib" / "python3"
    fake_stdlib(monkeypatch, tmp_path, {"json/__init__.py": "def dumps(x):\n" * 50, "os.py": "import sys\n" * 50})
    site, other = lib / "site-packages", tmp_path / "venv" / "site-packages"
    for folder, name, text in [(site / "pkg", "a.py", "x = 1\n"), (site / "pkg", "b.py", "y = 2\n"),
                               (other / "extra", "c.py", "z = 3\n")]:
        folder.mkdir(parents=True, exist_ok=True)
        (folder / name).write_text(text * 50)
    (site / "pkg" / "koi8.py").write_bytes(bytes(range(256)) * 4)
    target = tmp_path / "target"  # pip install --target: known by its .dist-info records
    (target / "tpkg-1.0.dist-info").mkdir(parents=True)
    (target / "tpkg").mkdir()
    (target / "tpkg" / "t.py").write_text("t = 4\n" * 50)
    (tmp_path / "repo").mkdir()
    (tmp_path / "repo" / "script.py").write_text("r = 5\n")  # a folder on sys.path without records: not a package folder
    (tmp_path / "alias").mkdir()
    os.symlink(other, tmp_path / "alias" / "site-packages", target_is_directory=True)
    paths = {**sysconfig.get_paths(), "purelib": str(site), "platlib": str(site)}
    monkeypatch.setattr(sysconfig, "get_paths", lambda: paths)
    monkeypatch.setattr(sys, "path", [str(tmp_path / "repo"), str(other), str(other),
                                      str(tmp_path / "alias" / "site-packages"), str(site), str(target)])
    stdlib = [str(lib / "json" / "__init__.py"), str(lib / "os.py")]
    assert stdlib_files() == stdlib
    assert stdlib_files(packages=True) == stdlib + [str(site / "pkg" / "a.py"), str(site / "pkg" / "b.py"),
                                                    str(target / "tpkg" / "t.py"), str(other / "extra" / "c.py")]
    cfg = data_cfg(kind="stdlib", packages=True, max_bytes=None, vocab_size=300, tokenizer_bytes=None,
                   val_fraction=0.05, cache_dir=str(tmp_path / "cache"))
    tok = load_corpus(cfg).tokenizer
    documents = [(np.asarray(load_corpus(data_cfg(**{**OmegaConf.to_container(cfg), "packages": p})).train_shards[0])
                  == tok.eos_id).sum() for p in (True, False)]
    assert documents == [6, 2]


def test_stdlib_corpus_leaves_out_files_that_are_not_text():
    """The standard library ships encoding-test fixtures that are not UTF-8 (module_koi8_r.py): the
    embedded corpus leaves them out instead of refusing the whole corpus."""
    from tritonllm.data.corpus import not_text

    files = stdlib_files()
    assert files and not_text(files) == []
