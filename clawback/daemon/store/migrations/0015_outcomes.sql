-- Outcome rewards: what the results of a call's actions state (daemon/outcomes.py; outcome events,
-- docs/protocol.md).
ALTER TABLE samples ADD COLUMN outcome TEXT;  -- the outcome rule's name or the outcome event's source

-- An outcome event's reward as credited to each main call of the trajectory it rates.
CREATE TABLE outcome_rewards (
    event_id    TEXT NOT NULL,                  -- the outcome event (feedback_events)
    call_id     TEXT NOT NULL,
    group_id    TEXT,                           -- step credit: trajectories of one task, normalised together
    step        INTEGER NOT NULL,               -- the call's index in its trajectory, from 0
    raw_reward  REAL NOT NULL,                  -- the event's reward
    reward      REAL NOT NULL,                  -- what the call gets (step credit: normalised per group and step)
    PRIMARY KEY (event_id, call_id)
);
CREATE INDEX outcome_rewards_call ON outcome_rewards(call_id);
CREATE INDEX outcome_rewards_group ON outcome_rewards(group_id, step);
