-- Why a sample with a teacher trains token-level OPD instead of top-K (NULL: top-K, or no teacher).
ALTER TABLE samples ADD COLUMN token_level_reason TEXT;
