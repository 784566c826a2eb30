"""Token streams for language modelling: the Wikipedia extract in gensim, or WikiText-2 files.

Both become one long stream of word ids per split, with ``<eos>`` closing every line (every
paragraph of the extract), as in PyTorch's word-language-model example.
"""

from __future__ import annotations

import bz2
import functools
import re
import xml.etree.ElementTree as ElementTree
from collections import Counter
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

from microsparse_lab.training.data.common import find_files, package_file

WIKI_FILE = (
    "test",
    "test_data",
    "enwiki-latest-pages-articles1.xml-p000000010p000030302-shortened.bz2",
)  # inside the installed gensim package
WIKITEXT_FILES = ["wiki.train.tokens", "wiki.valid.tokens", "wiki.test.tokens"]
WIKITEXT_FORMAT = (
    "WikiText-2 (wikitext-2): wiki.train.tokens, wiki.valid.tokens and wiki.test.tokens, "
    "UTF-8 text, tokens separated by spaces, one paragraph or heading per line"
)
UNKNOWN, END = "<unk>", "<eos>"
EMBEDDED_VOCABULARY = 10_000  # most frequent words of the extract, plus <unk>

_TOKEN = re.compile(r"[a-z]+(?:'[a-z]+)*|[0-9]+|[.,;:!?()]")
_MARKUP = [  # (pattern, replacement), applied in order to an article's wikitext
    (re.compile(r"<!--.*?-->", re.S), " "),
    (re.compile(r"<ref[^>/]*/>|<ref[^>]*>.*?</ref>", re.S), " "),
    (re.compile(r"\{\|.*?\|\}", re.S), " "),  # tables
    (re.compile(r"\[\[(?:file|image|category):[^\[\]]*(?:\[\[[^\]]*\]\][^\[\]]*)*\]\]", re.I), " "),
    (re.compile(r"\[\[(?:[^\]|]*\|)?([^\]]*)\]\]"), r"\1"),  # [[target|text]] -> text
    (re.compile(r"\[https?://\S+\s*([^\]]*)\]"), r"\1"),  # [url text] -> text
    (re.compile(r"<[^>]+>"), " "),  # remaining HTML tags
    (re.compile(r"'{2,}|={2,}|&[a-z]+;"), " "),  # bold, italics, headings, entities
]
_TEMPLATE = re.compile(r"\{\{[^{}]*\}\}")  # innermost templates; repeated to unnest


@dataclass(frozen=True)
class TextData:
    """Word-id streams of a corpus and its vocabulary (``vocabulary[id]`` is the word)."""

    train: torch.Tensor
    valid: torch.Tensor
    vocabulary: tuple[str, ...]

    @property
    def vocab_size(self) -> int:
        return len(self.vocabulary)


def tokenize(text: str) -> list[str]:
    """Lowercase words, numbers and basic punctuation.

    Example:
        >>> tokenize("The Cat's 3 hats, (red).")
        ['the', "cat's", '3', 'hats', ',', '(', 'red', ')', '.']
    """
    return _TOKEN.findall(text.lower())


def strip_wikitext(markup: str) -> str:
    """Plain text of a MediaWiki article: templates, references, tables and markup removed.

    Example:
        >>> strip_wikitext("'''Anarchism''' is a [[political philosophy|philosophy]]{{cn}}.")
        ' Anarchism  is a philosophy .'
    """
    previous = None
    while previous != markup:  # templates nest: strip innermost ones until none is left
        previous, markup = markup, _TEMPLATE.sub(" ", markup)
    for pattern, replacement in _MARKUP:
        markup = pattern.sub(replacement, markup)
    return markup


def wiki_articles(path: Path) -> Iterator[list[str]]:
    """Paragraphs of plain text of every article (namespace 0, no redirects) of a dump."""
    opener = bz2.open if path.suffix == ".bz2" else open
    with opener(path, "rb") as file:
        for _, element in ElementTree.iterparse(file):
            if not element.tag.endswith("}page"):
                continue
            namespace = element.findtext("{*}ns")
            text = element.findtext("{*}revision/{*}text") or ""
            if namespace == "0" and element.find("{*}redirect") is None:
                yield [line for line in strip_wikitext(text).splitlines() if tokenize(line)]
            element.clear()


def build_vocabulary(tokens: Iterable[str], size: int | None) -> tuple[str, ...]:
    """``<unk>`` then the ``size`` most frequent tokens (all if None); ties alphabetical.

    Example:
        >>> build_vocabulary("b a b c <unk>".split(), size=2)
        ('<unk>', 'b', 'a')
    """
    counts = Counter(tokens)
    counts.pop(UNKNOWN, None)
    ranked = sorted(counts, key=lambda word: (-counts[word], word))
    return (UNKNOWN, *(ranked if size is None else ranked[:size]))


def encode(tokens: list[str], vocabulary: tuple[str, ...]) -> torch.Tensor:
    """Word ids of ``tokens``; words outside ``vocabulary`` become ``<unk>`` (id 0)."""
    index = {word: position for position, word in enumerate(vocabulary)}
    return torch.tensor([index.get(token, 0) for token in tokens], dtype=torch.long)


@functools.lru_cache(maxsize=2)  # parsing takes seconds; the result is never modified
def embedded_text(vocab_size: int | None = None, valid_fraction: float = 0.1) -> TextData:
    """The Wikipedia extract shipped in ``gensim``: ~450 k tokens, whole articles per split.

    The last articles, about ``valid_fraction`` of the tokens, are the validation stream; the
    vocabulary is the training part's ``vocab_size`` (default 10,000) most frequent words.

    Example:
        >>> data = embedded_text()
        >>> data.vocab_size, data.train.numel() > 400_000, data.valid.numel() > 40_000
        (10001, True, True)
    """
    articles = [
        [token for paragraph in article for token in (*tokenize(paragraph), END)]
        for article in wiki_articles(package_file("gensim", *WIKI_FILE))
    ]
    total, split, seen = sum(map(len, articles)), len(articles), 0
    for index, article in enumerate(articles):
        seen += len(article)
        if seen >= (1 - valid_fraction) * total:
            split = index + 1
            break
    train = [token for article in articles[:split] for token in article]
    valid = [token for article in articles[split:] for token in article]
    vocabulary = build_vocabulary(train, vocab_size or EMBEDDED_VOCABULARY)
    return TextData(encode(train, vocabulary), encode(valid, vocabulary), vocabulary)


def wikitext(data_dir: str | Path, vocab_size: int | None = None) -> TextData:
    """WikiText-2 token files: every line's space-separated tokens, then ``<eos>``.

    The vocabulary is every training word (33,278 for WikiText-2), or its ``vocab_size`` most
    frequent ones. The test file must be present but only train and valid are used.

    Example:
        >>> wikitext("data/wikitext-2").vocab_size  # doctest: +SKIP
        33278
    """
    paths = find_files(data_dir, WIKITEXT_FILES, WIKITEXT_FORMAT, ("wikitext-2",))
    train, valid = (_read_tokens(path) for path in paths[:2])
    vocabulary = build_vocabulary(train, vocab_size)
    return TextData(encode(train, vocabulary), encode(valid, vocabulary), vocabulary)


def _read_tokens(path: Path) -> list[str]:
    with open(path, encoding="utf-8") as file:
        return [token for line in file for token in (*line.split(), END)]
