import pytest

from k2serve.tokenizer import KimiTokenizer, write_tokenizer_files


@pytest.fixture(scope="session")
def tok_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("tok1024")
    write_tokenizer_files(d, 1024)
    return d


@pytest.fixture(scope="session")
def tok(tok_dir):
    return KimiTokenizer.from_dir(tok_dir)
