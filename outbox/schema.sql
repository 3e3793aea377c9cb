-- caughtup outbox table, schema version 1. Migrate substitutes __TABLE__
-- and __INDEX__ (quoted identifiers) and runs this under an advisory lock,
-- so it is safe to apply on every start and from several processes at once.

CREATE TABLE IF NOT EXISTS __TABLE__ (
    -- Insertion order. Relays publish in this order within one batch; it is
    -- not commit order, which is why relays never keep a high-water mark.
    id           bigserial   PRIMARY KEY,
    -- What consumers dedupe on. Unlike id it survives a table rebuild and
    -- can be supplied by the producer as an idempotency key.
    event_id     text        NOT NULL,
    topic        text        NOT NULL,
    key          bytea,
    payload      bytea       NOT NULL,
    headers      jsonb       NOT NULL DEFAULT '{}'::jsonb,
    created_at   timestamptz NOT NULL DEFAULT now(),
    -- NULL until a polling relay marked the row (when it keeps rows rather
    -- than deleting them).
    published_at timestamptz
);

-- The polling relay's claim query scans only unpublished rows in id order;
-- the partial index keeps that cheap when published rows are kept.
CREATE INDEX IF NOT EXISTS __INDEX__ ON __TABLE__ (id) WHERE published_at IS NULL;
