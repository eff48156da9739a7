-- Slurm burst_buffer/lua for Locus: before a job's processes start, copy its dataset onto
-- the nodes it was given, peer to peer (`locus warm`, idempotent: nodes that already hold
-- it cost nothing). The job names its data with a directive in its batch script:
--
--   #BB_LUA locus_dataset=imagenet@3
--
-- Install as burst_buffer.lua next to slurm.conf with BurstBufferType=burst_buffer/lua.
-- The slurmctld host needs the `locus` CLI and LOCUS_METADATA / LOCUS_TOKEN (an admin
-- token) in slurmctld's environment, e.g. via a systemd drop-in.

local LOCUS = os.getenv("LOCUS_BIN") or "locus"

local function dataset_of(job_script)
  local f = io.open(job_script, "r")
  if f == nil then
    return nil
  end
  local text = f:read("*a")
  f:close()
  return string.match(text, "#BB_LUA%s+locus_dataset=([%w%._%-@,]+)")
end

-- Runs a shell command: whether it exited 0, and its output. Lua 5.1 (what Slurm links)
-- returns no exit status from a popen'd file's close(), so the shell prints it last.
local function run(cmd)
  local p = io.popen("(" .. cmd .. ") 2>&1; echo \"locus-rc=$?\"")
  if p == nil then
    return false, "cannot start a shell"
  end
  local out = p:read("*a")
  p:close()
  local code = string.match(out, "locus%-rc=(%d+)%s*$")
  out = string.gsub(out, "locus%-rc=%d+%s*$", "")
  return code == "0", out
end

-- Every hook the plugin calls; only pre_run does work.
function slurm_bb_job_process(job_script, uid, gid, job_info)
  return slurm.SUCCESS
end
function slurm_bb_pools()
  return slurm.SUCCESS
end
function slurm_bb_job_teardown(job_id, job_script, hurry, uid, gid)
  return slurm.SUCCESS
end
function slurm_bb_setup(job_id, uid, gid, pool, bb_size, job_script, job_info)
  return slurm.SUCCESS
end
function slurm_bb_data_in(job_id, job_script, uid, gid, job_info)
  return slurm.SUCCESS
end
function slurm_bb_real_size(job_id, uid, gid, job_info)
  return slurm.SUCCESS
end
function slurm_bb_paths(job_id, job_script, path_file, uid, gid, job_info)
  return slurm.SUCCESS
end
function slurm_bb_post_run(job_id, job_script, uid, gid, job_info)
  return slurm.SUCCESS
end
function slurm_bb_data_out(job_id, job_script, uid, gid, job_info)
  return slurm.SUCCESS
end
function slurm_bb_get_status(...)
  return slurm.SUCCESS
end

function slurm_bb_pre_run(job_id, job_script, uid, gid, job_info)
  local spec = dataset_of(job_script)
  if spec == nil then
    return slurm.SUCCESS
  end
  -- The job's nodes, one name per line, from its hostlist.
  local ok, nodes = run("scontrol show hostnames $(squeue -h -j " .. job_id .. " -o %N)")
  if not ok then
    slurm.log_error("locus: cannot list the nodes of job %s: %s", job_id, nodes)
    return slurm.SUCCESS -- run without warming rather than fail the job
  end
  local list = string.gsub(string.gsub(nodes, "%s+$", ""), "%s+", ",")
  for ref in string.gmatch(spec, "[^,]+") do
    local warmed, out = run(LOCUS .. " warm " .. ref .. " --nodes " .. list)
    if warmed then
      slurm.log_info("locus: job %s: %s", job_id, out)
    else
      slurm.log_error("locus: job %s: warming %s failed: %s", job_id, ref, out)
    end
  end
  return slurm.SUCCESS
end
