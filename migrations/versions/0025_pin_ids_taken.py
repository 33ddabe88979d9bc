"""A pin id taken on another instance fails the batch

Two owners could pin one id (owner, pin_id) on two instances at once: each checked the record
first, and the later batch's row replaced the earlier's, leaving that owner's machine holding a
pin the record no longer had. A batch's pin now replaces a recorded one only when that one was
removed or is on the same instance; otherwise `journal_pin_taken` fails the batch (KQ004).

Revision ID: 0025
Revises: 0024
Create Date: 2026-12-02
"""

from __future__ import annotations

from alembic import op

revision = "0025"
down_revision = "0024"
branch_labels = None
depends_on = None

PIN_TAKEN = """
CREATE FUNCTION journal_pin_taken(p_taken text[])
RETURNS void LANGUAGE plpgsql AS $$
BEGIN
    IF cardinality(p_taken) > 0 THEN
        RAISE EXCEPTION '%', array_to_string(p_taken, ' ') USING ERRCODE = 'KQ004';
    END IF;
END
$$
"""


def upgrade() -> None:
    op.execute(PIN_TAKEN)


def downgrade() -> None:
    op.execute("DROP FUNCTION journal_pin_taken(text[])")
