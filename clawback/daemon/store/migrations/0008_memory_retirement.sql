-- A preference note the live adapter already follows without it is retired: no longer injected
-- while a version descended from (or equal to) the one whose check retired it serves.
ALTER TABLE memory_notes ADD COLUMN retired_by INTEGER;  -- the adapter version whose replay showed the note redundant
ALTER TABLE memory_notes ADD COLUMN retired_at REAL;
