"""attempts.partial_state: what a cut attempt keeps beyond its text (reasoning, token ids), in a JSON column

Revision ID: 0008
Revises: 0007
Create Date: 2026-12-01 03:00:00

Before this, that state was a JSON object inside the text column `partial_output`, recognised by its opening
`{"holdback_partial":1,`, so an answer whose own text opened so was misread. The upgrade moves each such
object apart: its text stays in `partial_output`, the rest goes to `partial_state`; a value the old reader
took as plain text stays as it is. The downgrade folds the state back into that object.
"""

import json

from alembic import op
import sqlalchemy as sa

revision = '0008'
down_revision = '0007'
branch_labels = None
depends_on = None

# Frozen here: a migration must not change when holdback.attempts.resume does later.
MARKER_KEY = 'holdback_partial'
MARKER = '{"%s":1,' % MARKER_KEY
PAGE = 500  # rows read and rewritten at a time: the attempts table can be large

attempts = sa.table(
    'attempts',
    sa.column('id', sa.Integer()),
    sa.column('partial_output', sa.Text()),
    sa.column('partial_state', sa.JSON(none_as_null=True)),
)


def upgrade() -> None:
    with op.batch_alter_table('attempts', schema=None) as batch_op:
        batch_op.add_column(sa.Column('partial_state', sa.JSON(), nullable=True))
    # LIKE's `_` matches any character: `_split` checks the opening exactly.
    _rewrite(attempts.c.partial_output.like(MARKER + '%'), _split)


def downgrade() -> None:
    _rewrite(attempts.c.partial_state.is_not(None), _join)
    with op.batch_alter_table('attempts', schema=None) as batch_op:
        batch_op.drop_column('partial_state')


def _split(text, state):
    """An old combined value as (text, state); None when the old reader took it as plain text."""
    if text is None or not text.startswith(MARKER):
        return None
    try:
        doc = json.loads(text)
    except ValueError:
        return None
    if not isinstance(doc, dict) or not isinstance(doc.get('text'), str):
        return None
    rest = {k: v for k, v in doc.items() if k not in (MARKER_KEY, 'text')}
    return doc['text'], rest or None


def _join(text, state):
    if text is None or not isinstance(state, dict):
        return None
    doc = {MARKER_KEY: 1, 'text': text, **state}
    return json.dumps(doc, separators=(',', ':'), ensure_ascii=False), None


def _rewrite(where, change) -> None:
    """Apply `change` to the rows `where` selects, a page at a time in id order."""
    bind = op.get_bind()
    update = (sa.update(attempts).where(attempts.c.id == sa.bindparam('row_id'))
              .values(partial_output=sa.bindparam('text'), partial_state=sa.bindparam('state')))
    last = None
    while True:
        query = sa.select(attempts.c.id, attempts.c.partial_output, attempts.c.partial_state).where(where)
        if last is not None:
            query = query.where(attempts.c.id > last)
        rows = bind.execute(query.order_by(attempts.c.id).limit(PAGE)).all()
        if not rows:
            return
        last = rows[-1].id
        changes = []
        for row in rows:
            changed = change(row.partial_output, row.partial_state)
            if changed is not None:
                changes.append({'row_id': row.id, 'text': changed[0], 'state': changed[1]})
        if changes:
            bind.execute(update, changes)
