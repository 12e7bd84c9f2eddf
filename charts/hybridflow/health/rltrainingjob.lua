-- Argo CD health check for hybridflow.io/RLTrainingJob.
--
-- Register it in argocd-cm under resource.customizations.health.hybridflow.io_RLTrainingJob
-- (see docs/gitops.md). Modelled on Argo CD's built-in batch/Job check: a job that has not
-- reached an outcome is Progressing, even while it trains happily (status.conditions Ready=True),
-- because Healthy would claim the work is done. Order of decisions:
--   1. Failed=True                                 -> Degraded   (terminal: retries exhausted)
--   2. Succeeded=True                              -> Healthy    (terminal)
--   3. being deleted                               -> Progressing
--   4. status.observedGeneration < generation      -> Progressing (the operator has not seen the edit)
--   5. Stalled=True                                -> Degraded   (needs a human; the operator will not retry)
--   6. Suspended=True                              -> Suspended
--   7. Reconciling=True, Ready=True or anything else -> Progressing
-- Terminal outcomes come first so editing a finished job (say its TTL) never makes it look busy.
-- Stalled is checked before Reconciling, unlike kstatus, so a stuck job shows as Degraded in the UI.
-- Written for Lua 5.1, which is what Argo CD's interpreter (gopher-lua) implements.

local hs = {}

local function condition(status, kind)
  if status == nil or status.conditions == nil then
    return nil
  end
  for _, c in ipairs(status.conditions) do
    if c.type == kind then
      return c
    end
  end
  return nil
end

local function is_true(c)
  return c ~= nil and c.status == "True"
end

local function describe(c, fallback)
  if c == nil then
    return fallback
  end
  local text = c.reason or fallback
  if c.message ~= nil and c.message ~= "" then
    text = text .. ": " .. c.message
  end
  return text
end

local function progress(status)
  local p = status and status.progress
  if p == nil or p.step == nil then
    return ""
  end
  local text = " (step " .. tostring(p.step)
  if p.totalSteps ~= nil and p.totalSteps > 0 then
    text = text .. "/" .. tostring(p.totalSteps)
  end
  if p.rewardMean ~= nil then
    text = text .. string.format(", reward %.4g", p.rewardMean)
  end
  return text .. ")"
end

local function decide(obj)
  local status = obj.status
  local meta = obj.metadata or {}

  local failed = condition(status, "Failed")
  if is_true(failed) then
    return "Degraded", describe(failed, "Failed")
  end
  local succeeded = condition(status, "Succeeded")
  if is_true(succeeded) then
    return "Healthy", describe(succeeded, "Succeeded") .. progress(status)
  end
  if meta.deletionTimestamp ~= nil then
    return "Progressing", "Being deleted"
  end
  if status == nil then
    return "Progressing", "Waiting for the operator to observe the job"
  end
  -- Like kstatus: compared only once the operator reports an observedGeneration.
  if meta.generation ~= nil and status.observedGeneration ~= nil and status.observedGeneration < meta.generation then
    return "Progressing", "Waiting for the operator to observe generation " .. tostring(meta.generation)
  end
  local stalled = condition(status, "Stalled")
  if is_true(stalled) then
    return "Degraded", describe(stalled, "Stalled")
  end
  local suspended = condition(status, "Suspended")
  if is_true(suspended) then
    return "Suspended", describe(suspended, "Suspended")
  end
  local reconciling = condition(status, "Reconciling")
  if is_true(reconciling) then
    return "Progressing", describe(reconciling, "Reconciling") .. progress(status)
  end
  local ready = condition(status, "Ready")
  if is_true(ready) then
    return "Progressing", describe(ready, "Running") .. progress(status)
  end
  if ready ~= nil then
    return "Progressing", describe(ready, "Starting")
  end
  return "Progressing", "Waiting for the operator to report conditions"
end

hs.status, hs.message = decide(obj)
return hs
