-- Per-tenant read access to the bills for people (docs/reliability.md, "Access"), over the
-- tenant_access grants of sql/0010.
-- Row-level access for people: the rows of the tenants granted to the querying ClickHouse user
-- (or one of its current roles) in tenant_access (sql/0010; latest row per principal and tenant
-- wins, active = 0 revokes). On a server, grant users SELECT on these views only (and define them
-- with SQL SECURITY DEFINER there, see docs/reliability.md), never on the tables underneath.
CREATE VIEW IF NOT EXISTS my_tenant_daily_bill AS
SELECT * FROM tenant_daily_bill
WHERE tenant IN (SELECT tenant FROM tenant_access FINAL
                 WHERE active = 1 AND (principal = currentUser() OR has(currentRoles(), principal)));

CREATE VIEW IF NOT EXISTS my_job_cost AS
SELECT * FROM job_cost
WHERE tenant IN (SELECT tenant FROM tenant_access FINAL
                 WHERE active = 1 AND (principal = currentUser() OR has(currentRoles(), principal)));
