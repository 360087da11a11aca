"""Snapshot MACs and the keyring (no model, no sockets)."""

from __future__ import annotations

import dataclasses
import os
import stat

from quicsrv.engine import CONSTRAINED_SAMPLING, Grammar, SamplingParams
from quicsrv.sessions.keys import KeyRing
from quicsrv.sessions.snapshot import Snapshot
from quicsrv.sessions.spec import GenerationSpec


def _snapshot(session: bytes = b"s" * 16, generated=(5, 6, 7, 8)) -> Snapshot:
    return Snapshot(
        session_id=session,
        model_digest=b"m" * 32,
        spec=GenerationSpec(
            prompt_tokens=(1, 2, 3),
            sampling=SamplingParams(temperature=0.7, seed=42),
            max_tokens=16,
            stop=(),
            ignore_eos=False,
            prefill_chunk=256,
        ),
        generated=tuple(generated),
        created_at_s=0.0,
        expires_at_s=100.0,
    )


def test_every_older_checkpoint_hash_verifies_its_prefix():
    key = b"k" * 32
    early = _snapshot(generated=(5, 6))
    late = _snapshot()
    for index in (-1, 0, 1):
        assert late.verify([key], index, early.mac(key, index))
    assert not late.verify([key], 2, early.mac(key, 1))


def test_forged_foreign_and_out_of_range_hashes_fail():
    key = b"k" * 32
    snap = _snapshot()
    assert not snap.verify([key], 3, b"\x00" * 32)
    assert not snap.verify([key], 3, _snapshot(session=b"t" * 16).mac(key, 3))
    assert not snap.verify([key], 3, snap.mac(b"x" * 32, 3))
    assert not snap.verify([key], 4, snap.mac(key, 3))


def test_keyring_persists_0600_and_rotation_keeps_old_keys_until_they_expire(tmp_path):
    path = tmp_path / "data" / "mac-keys.json"
    ring = KeyRing.load_or_create(path, previous_key_ttl_s=10.0)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert KeyRing.load_or_create(path).current == ring.current
    old = ring.current
    ring.rotate(now_s=100.0)
    assert ring.current != old
    assert old in ring.verifying_keys(now_s=105.0)
    assert old not in ring.verifying_keys(now_s=111.0)


def test_a_running_keyring_picks_up_a_rotation_written_by_another_process(tmp_path):
    path = tmp_path / "mac-keys.json"
    running = KeyRing.load_or_create(path, previous_key_ttl_s=60.0)
    before = running.current
    other = KeyRing.load_or_create(path, previous_key_ttl_s=60.0)  # `quicsrv keys rotate`
    other.rotate(now_s=1000.0)
    other.save(path)
    os.utime(path, ns=(1, 1))  # a distinct mtime even on coarse-grained filesystems
    assert running.current == other.current != before
    assert before in running.verifying_keys(now_s=1030.0)
    assert before not in running.verifying_keys(now_s=1061.0)


def test_the_incremental_signer_gives_the_same_macs_as_a_snapshot_from_scratch():
    from array import array

    from quicsrv.sessions.snapshot import PrefixSigner

    key = b"k" * 32
    full = _snapshot(generated=tuple(range(100, 140)))
    tokens: array[int] = array("I")
    signer = PrefixSigner(full.header(), tokens, every=16)
    assert signer.mac(key, -1) == full.mac(key, -1)
    for token in full.generated:
        tokens.append(token)  # the session's record grows; the signer follows it
        index = len(tokens) - 1
        assert signer.mac(key, index) == full.mac(key, index)
    # Older prefixes (a resumed reader is replayed their checkpoints), marked or not.
    for index in (-1, 0, 15, 16, 31, 38):
        assert signer.mac(key, index) == full.mac(key, index)
        assert full.verify([key], index, signer.mac(key, index))


def test_checkpoints_issued_in_the_previous_format_still_verify():
    import blake3

    from quicsrv.sessions.snapshot import MAC_BYTES
    from quicsrv.sessions.tokens import digest_tokens
    from quicsrv_proto import canonical_cbor

    key = b"k" * 32
    snap = _snapshot()
    payload = {**snap.header(1), "index": 2, "tokens": digest_tokens(snap.generated[:3])}
    v1 = blake3.blake3(canonical_cbor(payload), key=key).digest(MAC_BYTES)
    assert v1 != snap.mac(key, 2)
    assert snap.verify([key], 2, v1)
    assert not snap.verify([key], 1, v1)


def test_the_grammar_is_part_of_what_a_hash_names_and_only_when_there_is_one():
    key = b"k" * 32
    plain = _snapshot()
    constrained = dataclasses.replace(
        plain, spec=dataclasses.replace(plain.spec, grammar=Grammar(gbnf="", digest=b"g" * 32))
    )
    other = dataclasses.replace(
        plain, spec=dataclasses.replace(plain.spec, grammar=Grammar(gbnf="", digest=b"h" * 32))
    )
    assert "grammar" not in plain.header()  # unconstrained sessions' hashes are unchanged
    assert constrained.header()["grammar"] == [b"g" * 32, CONSTRAINED_SAMPLING]
    hash_ = constrained.mac(key, 2)
    assert constrained.verify([key], 2, hash_)
    assert not plain.verify([key], 2, hash_) and not other.verify([key], 2, hash_)
