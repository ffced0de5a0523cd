-- The candidate gate: a version is `candidate` until the gate promotes it (then `live`) or
-- refuses it (`refused`, with `reason`); `gate` holds the gate's report (checks and numbers).
ALTER TABLE adapters ADD COLUMN gate TEXT NOT NULL DEFAULT '{}';
CREATE INDEX calls_adapter ON calls(adapter_version, turn_type, created_at);
