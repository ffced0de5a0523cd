-- A reply that falls into a repetition loop trains against the loop: the sample keeps the reply up
-- to the end of the loop's first repeat and penalises only that repeat (TrainConfig.loop_penalty).
ALTER TABLE samples ADD COLUMN loop_from INTEGER;  -- response token where the loop's first repeat starts
ALTER TABLE samples ADD COLUMN loop_to INTEGER;    -- exclusive end of that repeat: the sample trains response[:loop_to]
