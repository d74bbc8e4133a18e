package main

import (
	"encoding/json"
	"os"
	"path/filepath"
	"strings"
	"testing"
)

func writeSpec(t *testing.T, dir, file string, spec map[string]any) {
	t.Helper()
	data, err := json.Marshal(spec)
	if err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(dir, file), data, 0o644); err != nil {
		t.Fatal(err)
	}
}

// The pod's env comes after the device plugin's; both reach the process (containerd appends a
// name it did not set itself), getenv sees the first; a CDI edit replaces the LAST entry.
func TestCDIEditsReplaceTheCRIEnvAndMounts(t *testing.T) {
	dir := t.TempDir()
	writeSpec(t, dir, "grant.json", map[string]any{
		"cdiVersion": "0.5.0", "kind": "gpushare.io/grant",
		"devices": []any{map[string]any{"name": "g1", "containerEdits": map[string]any{
			"env": []string{"CUDA_DEVICE_MEMORY_LIMIT_0=1024m", "LD_PRELOAD=/usr/local/vgpu/libvgpu.so"},
			"mounts": []any{
				map[string]any{"hostPath": "/h/cache", "containerPath": "/usr/local/vgpu/cache", "options": []string{"rw"}},
				map[string]any{"hostPath": "/h/lib", "containerPath": "/usr/local/vgpu/libvgpu.so", "options": []string{"ro"}},
			},
		}}},
	})
	env := [][2]string{{"CUDA_DEVICE_MEMORY_LIMIT_0", "1024m"}, {"CUDA_DEVICE_MEMORY_LIMIT_0", "99999m"}, {"LD_PRELOAD", ""}, {"A", "1"}}
	mounts := []mount{{"/usr/local/vgpu/cache", "/tenant", false}, {"/tmp", "/tenant-tmp", false}}
	f := resolve("node-1", env, mounts, []string{"gpushare.io/grant=g1"}, []string{dir})
	entries := []string{}
	for _, kv := range f.Env {
		entries = append(entries, kv.Name+"="+kv.Value)
	}
	wantEnv := "PATH=" + defaultPath + " HOSTNAME=node-1 CUDA_DEVICE_MEMORY_LIMIT_0=1024m " +
		"CUDA_DEVICE_MEMORY_LIMIT_0=1024m LD_PRELOAD=/usr/local/vgpu/libvgpu.so A=1"
	if strings.Join(entries, " ") != wantEnv {
		t.Fatalf("final env %v\nwant %s", entries, wantEnv)
	}
	// without a CDI edit of the name, the tenant's duplicate stays second, getenv sees the first
	plain := resolve("node-1", [][2]string{{"X", "grant"}, {"X", "tenant"}, {"PATH", "/bin"}}, nil, nil, nil)
	if got := firstValues(plain.Env); got["X"] != "grant" || got["PATH"] != "/bin" || len(plain.Env) != 4 {
		t.Fatalf("env %v", plain.Env)
	}
	var paths []string
	for _, m := range f.Mounts {
		paths = append(paths, m.ContainerPath+"="+m.HostPath)
	}
	want := "/tmp=/tenant-tmp /usr/local/vgpu/cache=/h/cache /usr/local/vgpu/libvgpu.so=/h/lib"
	if strings.Join(paths, " ") != want {
		t.Fatalf("mounts %v", paths)
	}
	if f := resolve("n", nil, nil, []string{"gpushare.io/grant=nope"}, []string{dir}); len(f.Unresolved) != 1 {
		t.Fatalf("an unknown name must stay unresolved: %v", f.Unresolved)
	}
}

// createRuntime hooks get the OCI state on stdin for a live process; a failing one fails.
func TestHooksSeeTheStateAndFailClosed(t *testing.T) {
	dir := t.TempDir()
	out := filepath.Join(dir, "state.json")
	script := filepath.Join(dir, "hook.sh")
	if err := os.WriteFile(script, []byte("#!/bin/sh\ncat > \"$1\"\n[ \"$2\" = ok ]\n"), 0o755); err != nil {
		t.Fatal(err)
	}
	w, err := startWorkload("", "c1")
	if err != nil {
		t.Fatal(err)
	}
	defer w.stop()
	ok := []cdiHook{{HookName: "createRuntime", Path: script, Args: []string{"hook", out, "ok"}}}
	results, err := runHooks(ok, "c1", dir, w.cmd.Process.Pid)
	if err != nil || len(results) != 1 || results[0].ExitCode != 0 {
		t.Fatalf("hook: %v %+v", err, results)
	}
	var state map[string]any
	data, _ := os.ReadFile(out)
	if err := json.Unmarshal(data, &state); err != nil {
		t.Fatal(err)
	}
	if state["status"] != "creating" || int(state["pid"].(float64)) != w.cmd.Process.Pid || state["id"] != "c1" {
		t.Fatalf("state %v", state)
	}
	bad := []cdiHook{{HookName: "createRuntime", Path: script, Args: []string{"hook", out, "no"}}}
	if results, err := runHooks(bad, "c1", dir, w.cmd.Process.Pid); err == nil || results[0].ExitCode != 1 {
		t.Fatalf("a failing hook must fail: %v %+v", err, results)
	}
}

// The bundle's config.json holds the final env, in order, as process.env.
func TestConfigHoldsTheFinalEnv(t *testing.T) {
	dir := t.TempDir()
	env := []envVar{{"A", "1"}, {"CUDA_DEVICE_MEMORY_LIMIT_0", "1024m"}, {"B", "x=y"}}
	if err := writeConfig(dir, env); err != nil {
		t.Fatal(err)
	}
	var config struct {
		Process struct {
			Env []string `json:"env"`
		} `json:"process"`
	}
	data, _ := os.ReadFile(filepath.Join(dir, "config.json"))
	if err := json.Unmarshal(data, &config); err != nil {
		t.Fatal(err)
	}
	want := []string{"A=1", "CUDA_DEVICE_MEMORY_LIMIT_0=1024m", "B=x=y"}
	if strings.Join(config.Process.Env, "\n") != strings.Join(want, "\n") {
		t.Fatalf("env %v, want %v", config.Process.Env, want)
	}
}
