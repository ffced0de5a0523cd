-- Positive evidence: the teacher's logprobs of its own reply under the hint, so the evidence row
-- carries the OPD term (trainer/config.py evidence_weight), and the context it trains in where
-- that is not the sample's (a disliked reply's evidence, trained without the notes).
ALTER TABLE samples ADD COLUMN evidence_teacher_logprobs BLOB;  -- float32, one per evidence_ids token
ALTER TABLE samples ADD COLUMN evidence_prompt_ids BLOB;        -- int32; NULL: the sample's own prompt
