"""Credentials in store URLs and connection strings are masked wherever they are shown."""

from __future__ import annotations

import pytest

from weft_sync.redaction import redact_text, redact_url
from weft_sync.storage import open_storage


@pytest.mark.parametrize(
    ("url", "shown"),
    [
        ("postgresql://app:s3cret@db:5432/main", "postgresql://app:***@db:5432/main"),
        ("postgres://app:p@ss:w0rd@db/main", "postgres://app:***@db/main"),
        (
            "postgresql://db/main?password=s3cret&sslmode=off",
            "postgresql://db/main?password=***&sslmode=off",
        ),
        ("postgresql://app@db/main?sslpassword=s3cret", "postgresql://app@db/main?sslpassword=***"),
        ("postgresql://app@db:5432/main", "postgresql://app@db:5432/main"),
        ("sqlite:////var/lib/app/weft.db?table=t", "sqlite:////var/lib/app/weft.db?table=t"),
    ],
)
def test_redact_url_masks_only_the_password(url: str, shown: str) -> None:
    assert redact_url(url) == shown


def test_redact_text_masks_urls_and_libpq_keywords_inside_a_message() -> None:
    text = (
        "failed on 'postgresql://app:s3cret@db/main': host=db password='a b' user=app "
        "dbname=x PASSWORD=plain"
    )
    masked = redact_text(text)
    assert "s3cret" not in masked and "a b" not in masked and "plain" not in masked
    assert masked == (
        "failed on 'postgresql://app:***@db/main': host=db password=*** user=app "
        "dbname=x PASSWORD=***"
    )


@pytest.mark.parametrize(
    "url",
    [
        "postgresql://app:s3cret@127.0.0.1:1/main?table=bad-name",
        "postgresql://app:s3cret@127.0.0.1:1/main?min_size=many",
        "postgresql://127.0.0.1:1/main?password=s3cret&timeout=soon",
        "postgresql://app:s3cret@127.0.0.1:1/main?not_a_libpq_parameter=1",
        "sqlite:///x.db?password=s3cret",
    ],
)
def test_open_storage_errors_never_show_the_password(url: str) -> None:
    with pytest.raises(ValueError) as caught:
        open_storage(url)
    assert "s3cret" not in str(caught.value)


def test_an_unknown_sqlite_parameter_error_shows_the_masked_url() -> None:
    with pytest.raises(ValueError, match=r"'sqlite:///x\.db\?password=\*\*\*'"):
        open_storage("sqlite:///x.db?password=s3cret")
