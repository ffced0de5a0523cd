-- Indexes for the dashboard's aggregates, so that they read indexes instead of every call row
-- (a call row holds its token ids and text): main calls by state and by adapter version, the
-- version of a feedback event's call, the newest feedback events.
CREATE INDEX calls_turn_state ON calls(turn_type, state, adapter_version);
CREATE INDEX calls_version ON calls(call_id, turn_type, adapter_version);
CREATE INDEX feedback_received ON feedback_events(received_at);
