"""config/private_files.py: dflashctl runs what its cache holds (a pickled config,
remembered command lines) only from a file nobody else could have written."""

from __future__ import annotations

from dflashctl.config.private_files import only_ours


def test_only_a_regular_file_in_a_folder_nobody_else_writes_is_trusted(tmp_path):
    folder = tmp_path / "cache"
    folder.mkdir(mode=0o700)
    folder.chmod(0o700)
    file = folder / "config.pickle"
    file.write_bytes(b"data")
    file.chmod(0o600)
    assert only_ours(file)

    file.chmod(0o620)  # group-writable
    assert not only_ours(file)
    file.chmod(0o602)  # writable by anyone
    assert not only_ours(file)
    file.chmod(0o600)

    folder.chmod(0o770)  # another user could swap the file in
    assert not only_ours(file)
    folder.chmod(0o700)

    link = folder / "link.pickle"
    link.symlink_to(file)
    assert not only_ours(link)  # a link may lead anywhere
    assert not only_ours(folder / "missing.pickle")
    assert not only_ours(folder)  # a folder is no file
