-- A version that leaves live is `committed` again when a newer version replaced it, `retired`
-- when a rollback took it out of service, and `refused` again when it was promoted over the
-- gate's refusal. Older rows called all three `retired`: the live version's predecessors were
-- replaced, and a refused one keeps its reason.
UPDATE adapters SET state = 'refused' WHERE state = 'retired' AND reason IS NOT NULL;
UPDATE adapters SET state = 'committed' WHERE state = 'retired' AND version < (SELECT version FROM adapters WHERE state = 'live');
