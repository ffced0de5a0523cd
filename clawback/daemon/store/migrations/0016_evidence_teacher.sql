-- Positive evidence: the teacher's logprobs of its own reply under the hint, so the evidence row
-- carries the OPD term (trainer/config.py evidence_weight).
ALTER TABLE samples ADD COLUMN evidence_teacher_logprobs BLOB;  -- float32, one per evidence_ids token
