-- gpumem's Slurm hooks (cli_filter.lua, job_submit.lua) share this: whether a job states a
-- model for gpumem, and `gpumem slurm request`'s answer for it.
local M = {}

-- Where gpumem and the cluster's GPU types are; the environment overrides (GPUMEM_BIN,
-- GPUMEM_SLURM_CONFIG), e.g. in slurmctld's systemd unit.
M.bin = os.getenv("GPUMEM_BIN") or "/usr/local/bin/gpumem"
M.config = os.getenv("GPUMEM_SLURM_CONFIG") or "/etc/gpumem/slurm.toml"

local function quote(s)
  return "'" .. string.gsub(s, "'", "'\\''") .. "'"
end

-- Whether a job has #GPUMEM lines or a gpumem: comment; a job without costs no process.
function M.states_a_model(script, comment)
  if comment and string.find(comment, "gpumem:", 1, true) then return true end
  return script ~= nil and (string.find(script, "^#GPUMEM") ~= nil or string.find(script, "\n#GPUMEM") ~= nil)
end

-- Runs `gpumem slurm request` on a job: { script = path, comment, gres, constraint, chdir
-- (where a relative train_config= is read), no_trace = bool }. Returns the request ({ gres,
-- constraint, comment }, empty for a job gpumem leaves as it is), or nil and gpumem's one-line
-- reason.
function M.request(job)
  local cmd = quote(M.bin) .. " slurm request --config " .. quote(M.config)
  if job.script then cmd = cmd .. " " .. quote(job.script) end
  for _, key in ipairs({ "comment", "gres", "constraint", "chdir" }) do
    if job[key] and job[key] ~= "" then cmd = cmd .. " --" .. key .. " " .. quote(job[key]) end
  end
  if job.no_trace then cmd = cmd .. " --no-trace" end
  -- Lua 5.1's popen gives no exit status: gpumem's answer is its key=value lines on stdout; with
  -- none, the first line of its stderr (its `error: …`, or the shell's when gpumem is missing)
  -- is why it refused, and an empty stderr means the job is not gpumem's.
  local err_path = os.tmpname()
  local pipe = io.popen(cmd .. " 2>" .. quote(err_path), "r")
  if not pipe then
    os.remove(err_path)
    return nil, "gpumem: cannot run " .. M.bin
  end
  local out = pipe:read("*a") or ""
  pipe:close()
  local f = io.open(err_path, "r")
  local err = f and f:read("*a") or ""
  if f then f:close() end
  os.remove(err_path)
  local answer, any = {}, false
  for line in string.gmatch(out, "[^\n]+") do
    local key, value = string.match(line, "^(%l+)=(.*)$")
    if key == "gres" or key == "constraint" or key == "comment" then
      answer[key], any = value, true
    end
  end
  if not any then
    local first = string.match(err, "[^\n]+")
    if first then return nil, "gpumem: " .. string.gsub(first, "^error: ", "") end
  end
  return answer
end

return M
