package main

// What a CDI-aware runtime (containerd, CRI-O) finally gives a container, done here the way the
// CDI library does it (tags.cncf.io/container-device-interface, pkg/cdi/container-edits.go and
// internal/ociedit/spec_editor.go, read for this; not imported, only the behaviour is copied):
//
//   - the CRI config's env is merged first as containerd 2.4 does it (criEnv): PATH and
//     HOSTNAME, then the image's env and the CRI env as one list, a name of the first two
//     replaced in place, every other entry APPENDED, so a name the kubelet sends twice (the
//     device plugin's, then the pod's own) is in the process's environ twice, in that order;
//     getenv(3) returns the first;
//   - then every CDI device the kubelet named (CreateContainerRequest.config.CDI_devices, then
//     the cdi.k8s.io/* annotations), in that order, with its spec's own containerEdits first:
//     an env entry replaces the LAST entry of that name (the CDI library's cache maps a name
//     to its last index; an earlier duplicate stays) or is appended; a mount first removes the (first) mount at
//     the same container path, then is appended, and the mounts are sorted by depth, stably,
//     after each device that has mounts; hooks are appended per OCI hook point;
//   - a name that no spec in the CDI directories defines fails the container's creation.
//
// The createRuntime hooks are then run as a runtime runs them: after the container's process
// exists and <bundle>/config.json holds the final env as process.env, with the OCI state on stdin ({ociVersion, id, status "creating", pid, bundle}), the
// hook's args as its argv and its env as its environment; a hook that exits non-zero or outlives
// its timeout fails CreateContainer. The process is a real child (sleep) placed in a cgroup v2
// directory of its own under --cgroup-root when the machine has cgroup v2 there, otherwise it
// stays where it is and the record says so; it is killed when the container is removed.

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"sort"
	"strings"
	"syscall"
	"time"

	"sigs.k8s.io/yaml"
)

type cdiMount struct {
	HostPath      string   `json:"hostPath"`
	ContainerPath string   `json:"containerPath"`
	Options       []string `json:"options,omitempty"`
}

type cdiHook struct {
	HookName string   `json:"hookName"`
	Path     string   `json:"path"`
	Args     []string `json:"args,omitempty"`
	Env      []string `json:"env,omitempty"`
	Timeout  *int     `json:"timeout,omitempty"`
}

type cdiEdits struct {
	Env    []string   `json:"env,omitempty"`
	Mounts []cdiMount `json:"mounts,omitempty"`
	Hooks  []cdiHook  `json:"hooks,omitempty"`
}

type cdiDevice struct {
	Name           string   `json:"name"`
	ContainerEdits cdiEdits `json:"containerEdits"`
}

type cdiSpec struct {
	Kind           string      `json:"kind"`
	Devices        []cdiDevice `json:"devices"`
	ContainerEdits cdiEdits    `json:"containerEdits"`
}

type resolvedDevice struct {
	spec   string // the spec file
	global cdiEdits
	device cdiEdits
}

// readCDI reads every spec (*.json, *.yaml, *.yml) of the directories; a later directory's
// device of the same name wins, as in the CDI registry (later directories have priority).
func readCDI(dirs []string) (map[string]resolvedDevice, []string) {
	found := map[string]resolvedDevice{}
	var problems []string
	for _, dir := range dirs {
		entries, err := os.ReadDir(dir)
		if err != nil {
			continue
		}
		for _, e := range entries {
			ext := filepath.Ext(e.Name())
			if e.IsDir() || (ext != ".json" && ext != ".yaml" && ext != ".yml") {
				continue
			}
			path := filepath.Join(dir, e.Name())
			data, err := os.ReadFile(path)
			if err != nil {
				problems = append(problems, fmt.Sprintf("%s: %v", path, err))
				continue
			}
			var spec cdiSpec
			if err := yaml.Unmarshal(data, &spec); err != nil {
				problems = append(problems, fmt.Sprintf("%s: %v", path, err))
				continue
			}
			for _, d := range spec.Devices {
				found[spec.Kind+"="+d.Name] = resolvedDevice{path, spec.ContainerEdits, d.ContainerEdits}
			}
		}
	}
	return found, problems
}

type envVar struct {
	Name  string `json:"name"`
	Value string `json:"value"`
}

type hookResult struct {
	Name     string   `json:"name"`
	Path     string   `json:"path"`
	Args     []string `json:"args"`
	Env      []string `json:"env"`
	ExitCode int      `json:"exit_code"`
	Stdout   string   `json:"stdout"`
	Stderr   string   `json:"stderr"`
	Error    string   `json:"error,omitempty"`
}

// finalConfig is what the runtime applies: the CRI config merged, then the CDI devices.
type finalConfig struct {
	Env        []envVar  // in the container's order
	Mounts     []mount   // in mount order
	Hooks      []cdiHook // createRuntime hooks, in order
	Unresolved []string
	Specs      []string // the spec files used
}

// setEnv is a CDI env edit: the last entry of the name replaced, or one appended.
func (f *finalConfig) setEnv(name, value string) {
	for i := len(f.Env) - 1; i >= 0; i-- {
		if f.Env[i].Name == name {
			f.Env[i].Value = value
			return
		}
	}
	f.Env = append(f.Env, envVar{name, value})
}

// defaultPath is containerd's oci.DefaultPathEnv on Linux.
const defaultPath = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"

// criEnv is the process env containerd 2.4's CRI builds before the CDI edits
// (internal/cri/server/container_create.go, pkg/oci's replaceOrAppendEnvValues): PATH and
// HOSTNAME (the sandbox's hostname) first; then the image's env followed by the CRI env as
// ONE list of overrides, in which a name already among the first two is replaced in place and
// every other entry is appended, also when the list names it twice: its cache of names is not
// updated while appending. The fake's images have no env of their own.
func criEnv(hostname string, env [][2]string) []envVar {
	out := []envVar{{"PATH", defaultPath}, {"HOSTNAME", hostname}}
	base := map[string]int{"PATH": 0, "HOSTNAME": 1}
	for _, kv := range env {
		if i, ok := base[kv[0]]; ok {
			out[i].Value = kv[1]
			continue
		}
		out = append(out, envVar{kv[0], kv[1]})
	}
	return out
}

// firstValues is what getenv(3) returns for each name: its first entry.
func firstValues(env []envVar) map[string]string {
	out := map[string]string{}
	for _, kv := range env {
		if _, ok := out[kv.Name]; !ok {
			out[kv.Name] = kv.Value
		}
	}
	return out
}

func depth(path string) int {
	return strings.Count(filepath.Clean(path), string(os.PathSeparator))
}

func (f *finalConfig) apply(e cdiEdits) {
	for _, kv := range e.Env {
		name, value, _ := strings.Cut(kv, "=")
		f.setEnv(name, value)
	}
	for _, m := range e.Mounts {
		for i := range f.Mounts {
			if f.Mounts[i].ContainerPath == m.ContainerPath {
				f.Mounts = append(f.Mounts[:i], f.Mounts[i+1:]...)
				break
			}
		}
		readonly := false
		for _, o := range m.Options {
			if o == "ro" {
				readonly = true
			}
		}
		f.Mounts = append(f.Mounts, mount{m.ContainerPath, m.HostPath, readonly})
	}
	if len(e.Mounts) > 0 {
		sort.SliceStable(f.Mounts, func(i, j int) bool {
			return depth(f.Mounts[i].ContainerPath) < depth(f.Mounts[j].ContainerPath)
		})
	}
	for _, h := range e.Hooks {
		if h.HookName == "createRuntime" {
			f.Hooks = append(f.Hooks, h)
		}
	}
}

// resolve merges the CRI env (criEnv, for a sandbox of this hostname) and mounts and applies
// the named CDI devices.
func resolve(hostname string, env [][2]string, mounts []mount, names []string, dirs []string) finalConfig {
	f := finalConfig{Env: criEnv(hostname, env)}
	f.Mounts = append(f.Mounts, mounts...)
	devices, problems := readCDI(dirs)
	for _, p := range problems {
		fmt.Fprintf(os.Stderr, "crifake: CDI spec unreadable: %s\n", p)
	}
	appliedSpecs := map[string]bool{}
	seen := map[string]bool{}
	for _, name := range names {
		if seen[name] {
			continue
		}
		seen[name] = true
		d, ok := devices[name]
		if !ok {
			f.Unresolved = append(f.Unresolved, name)
			continue
		}
		if !appliedSpecs[d.spec] { // a spec's own edits once, with its first device
			appliedSpecs[d.spec] = true
			f.Specs = append(f.Specs, d.spec)
			f.apply(d.global)
		}
		f.apply(d.device)
	}
	return f
}

// cdiNames are the CDI devices the kubelet names: the CRI field, then the annotations.
func cdiNames(fromCRI []string, annotations map[string]string) []string {
	names := append([]string{}, fromCRI...)
	keys := make([]string, 0, len(annotations))
	for k := range annotations {
		if strings.HasPrefix(k, "cdi.k8s.io/") {
			keys = append(keys, k)
		}
	}
	sort.Strings(keys)
	for _, k := range keys {
		for _, n := range strings.Split(annotations[k], ",") {
			if n = strings.TrimSpace(n); n != "" {
				names = append(names, n)
			}
		}
	}
	return names
}

// workload is the container's stand-in process: a real child, in a cgroup v2 directory of its
// own where the machine has one.
type workload struct {
	cmd    *exec.Cmd
	cgroup string // the directory under /sys/fs/cgroup, "" when not on cgroup v2
}

func (w *workload) stop() {
	if w.cmd != nil && w.cmd.Process != nil {
		_ = w.cmd.Process.Kill()
		_, _ = w.cmd.Process.Wait()
	}
	if w.cgroup != "" {
		_ = os.Remove(w.cgroup)
	}
}

func isCgroup2(root string) bool {
	var st syscall.Statfs_t
	if err := syscall.Statfs(root, &st); err != nil {
		return false
	}
	return st.Type == 0x63677270 // CGROUP2_SUPER_MAGIC
}

// startWorkload starts the stand-in process; with cgroup v2 at cgroupRoot it is moved into
// <cgroupRoot>/k8s.io/<id> (containerd's path) before any hook runs.
func startWorkload(cgroupRoot, id string) (*workload, error) {
	cmd := exec.Command("sleep", "86400")
	if err := cmd.Start(); err != nil {
		return nil, fmt.Errorf("starting the container's process: %w", err)
	}
	w := &workload{cmd: cmd}
	if cgroupRoot != "" && isCgroup2(cgroupRoot) {
		dir := filepath.Join(cgroupRoot, "k8s.io", id) // containerd's path when the kubelet names no parent
		if err := os.MkdirAll(dir, 0o755); err == nil {
			if err := os.WriteFile(filepath.Join(dir, "cgroup.procs"), []byte(fmt.Sprint(cmd.Process.Pid)), 0o644); err == nil {
				w.cgroup = dir
			} else {
				fmt.Fprintf(os.Stderr, "crifake: moving %d into %s: %v\n", cmd.Process.Pid, dir, err)
				_ = os.Remove(dir)
			}
		} else {
			fmt.Fprintf(os.Stderr, "crifake: creating %s: %v\n", dir, err)
		}
	}
	return w, nil
}

// writeConfig writes <bundle>/config.json as a runtime does before its hooks run, with the
// container's final env as process.env (NAME=VALUE, in the container's order); the hooks read
// it from the bundle named in the OCI state (the limit check of DRA claims does).
func writeConfig(bundle string, env []envVar) error {
	entries := make([]string, 0, len(env))
	for _, kv := range env {
		entries = append(entries, kv.Name+"="+kv.Value)
	}
	data, err := json.Marshal(map[string]any{
		"ociVersion": "1.3.0", // runc 1.5.3's
		"process":    map[string]any{"env": entries},
	})
	if err != nil {
		return err
	}
	if err := os.WriteFile(filepath.Join(bundle, "config.json"), data, 0o644); err != nil {
		return fmt.Errorf("writing the bundle's config.json: %w", err)
	}
	return nil
}

// runHooks runs the createRuntime hooks in order with the OCI state on stdin; the first that
// fails stops the rest and is the error.
func runHooks(hooks []cdiHook, id, bundle string, pid int) ([]hookResult, error) {
	state, _ := json.Marshal(map[string]any{
		"ociVersion": "1.3.0", // runc 1.5.3's
		"id":         id,
		"status":     "creating",
		"pid":        pid,
		"bundle":     bundle,
	})
	var results []hookResult
	for _, h := range hooks {
		timeout := 10 * time.Second
		if h.Timeout != nil && *h.Timeout > 0 {
			timeout = time.Duration(*h.Timeout) * time.Second
		}
		ctx, cancel := context.WithTimeout(context.Background(), timeout)
		cmd := exec.CommandContext(ctx, h.Path)
		if len(h.Args) > 0 { // OCI: args are argv, args[0] included
			cmd.Args = h.Args
		}
		cmd.Env = h.Env
		cmd.Stdin = bytes.NewReader(state)
		var stdout, stderr bytes.Buffer
		cmd.Stdout, cmd.Stderr = &stdout, &stderr
		err := cmd.Run()
		cancel()
		r := hookResult{Name: h.HookName, Path: h.Path, Args: cmd.Args, Env: h.Env,
			ExitCode: -1, Stdout: stdout.String(), Stderr: stderr.String()}
		if cmd.ProcessState != nil {
			r.ExitCode = cmd.ProcessState.ExitCode()
		}
		if err != nil {
			r.Error = err.Error()
			results = append(results, r)
			return results, fmt.Errorf("createRuntime hook %s failed: %v: %s", h.Path, err, strings.TrimSpace(stderr.String()))
		}
		results = append(results, r)
	}
	return results, nil
}
