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

-- Runs `gpumem slurm request` on a job: { script = path, comment, gres, constraint,
-- no_trace = bool }. Returns the request ({ gres, constraint, comment }, empty for a job gpumem
-- leaves as it is), or nil and gpumem's one-line reason.
function M.request(job)
  local cmd = quote(M.bin) .. " slurm request --config " .. quote(M.config)
  if job.script then cmd = cmd .. " " .. quote(job.script) end
  for _, key in ipairs({ "comment", "gres", "constraint" }) do
    if job[key] and job[key] ~= "" then cmd = cmd .. " --" .. key .. " " .. quote(job[key]) end
  end
  if job.no_trace then cmd = cmd .. " --no-trace" end
  -- Lua 5.1's popen gives no exit status: gpumem's answer is key=value lines, and any other
  -- line (its `error: …`, or the shell's when gpumem is missing) is the reason it failed.
  local pipe = io.popen(cmd .. " 2>&1", "r")
  if not pipe then return nil, "gpumem: cannot run " .. M.bin end
  local out = pipe:read("*a") or ""
  pipe:close()
  local answer = {}
  for line in string.gmatch(out, "[^\n]+") do
    local key, value = string.match(line, "^(%l+)=(.*)$")
    if key == "gres" or key == "constraint" or key == "comment" then
      answer[key] = value
    else
      return nil, "gpumem: " .. string.gsub(line, "^error: ", "")
    end
  end
  return answer
end

return M
