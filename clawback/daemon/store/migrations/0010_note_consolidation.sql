-- A reply served with preference notes trains in its request without them (note consolidation):
-- that prompt, and the serving version's logprobs there, the baseline of its advantage.
ALTER TABLE samples ADD COLUMN student_prompt_ids BLOB;    -- int32: the request as served minus its injected notes, rendered
ALTER TABLE samples ADD COLUMN student_logprobs BLOB;      -- float32 per response token: the serving version's logprobs under student_prompt_ids
ALTER TABLE samples ADD COLUMN student_top_logprobs BLOB;  -- float32 T x K: the same for calls.top_ids
