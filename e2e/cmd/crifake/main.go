// crifake serves Kubernetes' own CRI fake (k8s.io/cri-client/pkg/fake) on a unix socket for one
// kubelet, and records what the kubelet asks the runtime to create: for every CreateContainer,
// one JSON line with the pod, the container and the config the runtime FINALLY applies: the CRI
// env merged (a later duplicate wins), then the CDI devices the kubelet named, resolved from the
// specs in --cdi-dirs and applied as the CDI library does (env replaced by name, mounts replaced
// by container path), and the result of each createRuntime hook they carry, run with an OCI state
// on stdin for a real process (cdi.go). "env" and "mounts" are that final config; "cri_env" and
// "cri_mounts" what the kubelet sent. A CDI name no spec defines, or a failing hook, fails the
// CreateContainer (as in a runtime) and is recorded with "error". The e2e tests read that file
// instead of looking inside a real container. Every call, CreateContainer included, is answered by the fake, with
// one addition: the fake's containers run until stopped, so an init container would never
// finish and its pod never start; with --kubeconfig (the node's credentials) crifake reads the
// pod of each created container and lets an init container (not a restartable sidecar) exit 0
// as soon as it is started.
package main

import (
	"context"
	"encoding/json"
	"flag"
	"fmt"
	"net"
	"os"
	"os/signal"
	"path/filepath"
	"strings"
	"sync"
	"syscall"
	"time"

	"google.golang.org/grpc"
	v1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/tools/clientcmd"
	kubeapi "k8s.io/cri-api/pkg/apis/runtime/v1"
	"k8s.io/cri-client/pkg/fake"
)

type mount struct {
	ContainerPath string `json:"container_path"`
	HostPath      string `json:"host_path"`
	Readonly      bool   `json:"readonly"`
}

type device struct {
	ContainerPath string `json:"container_path"`
	HostPath      string `json:"host_path"`
	Permissions   string `json:"permissions"`
}

type record struct {
	Time         string   `json:"time"`
	ContainerID  string   `json:"container_id"`
	PodSandboxID string   `json:"pod_sandbox_id"`
	Namespace    string   `json:"namespace"`
	Pod          string   `json:"pod"`
	PodUID       string   `json:"pod_uid"`
	Container    string   `json:"container"`
	Attempt      uint32   `json:"attempt"`
	Image        string   `json:"image"`
	Command      []string `json:"command"`
	Args         []string `json:"args"`
	// what getenv(3) in the container returns per name (the first entry of a name)
	Env map[string]string `json:"env"`
	// the container's whole process.env, in order (a name can be there twice: cdi.go)
	Environ     []string          `json:"environ"`
	Mounts      []mount           `json:"mounts"`
	Devices     []device          `json:"devices"`
	CDIDevices  []string          `json:"cdi_devices"`
	Annotations map[string]string `json:"annotations"`
	// what the kubelet sent, before the runtime's merge and the CDI edits
	CRIEnv    []envVar `json:"cri_env"`
	CRIMounts []mount  `json:"cri_mounts"`
	// the CDI devices applied (CRI field, then annotations), the spec files they came from
	CDIApplied []string     `json:"cdi_applied"`
	CDISpecs   []string     `json:"cdi_specs"`
	Hooks      []hookResult `json:"hooks"`
	// the container's process the hooks saw: its pid and cgroup v2 directory ("" without one)
	Pid    int    `json:"pid"`
	Cgroup string `json:"cgroup"`
	Error  string `json:"error,omitempty"`
}

// recorder is the runtime service the kubelet talks to: the fake, with CreateContainer recorded.
type recorder struct {
	*fake.RemoteRuntime
	mu     sync.Mutex
	out    *os.File
	client kubernetes.Interface // nil: no init container ever finishes
	// containers that exit 0 as soon as they are started (init containers)
	exitOnStart map[string]bool
	cdiDirs     []string
	cgroupRoot  string
	bundles     string
	workloads   map[string]*workload
}

// isInitContainer says whether the pod's spec lists the container as an init container that
// runs to completion (not a sidecar with restartPolicy Always).
func (r *recorder) isInitContainer(ctx context.Context, ns, pod, container string) bool {
	if r.client == nil {
		return false
	}
	p, err := r.client.CoreV1().Pods(ns).Get(ctx, pod, metav1.GetOptions{})
	if err != nil {
		fmt.Fprintf(os.Stderr, "crifake: reading pod %s/%s: %v\n", ns, pod, err)
		return false
	}
	for _, c := range p.Spec.InitContainers {
		if c.Name == container {
			return c.RestartPolicy == nil || *c.RestartPolicy != v1.ContainerRestartPolicyAlways
		}
	}
	return false
}

func (r *recorder) StartContainer(ctx context.Context, req *kubeapi.StartContainerRequest) (*kubeapi.StartContainerResponse, error) {
	resp, err := r.RemoteRuntime.StartContainer(ctx, req)
	if err != nil {
		return nil, err
	}
	r.mu.Lock()
	exit := r.exitOnStart[req.GetContainerId()]
	r.mu.Unlock()
	if exit {
		fakeRuntime := r.RemoteRuntime.RuntimeService
		fakeRuntime.Lock()
		if c, ok := fakeRuntime.Containers[req.GetContainerId()]; ok {
			c.State = kubeapi.ContainerState_CONTAINER_EXITED
			c.ExitCode = 0
			c.Reason = "Completed"
			c.FinishedAt = time.Now().UnixNano()
		}
		fakeRuntime.Unlock()
	}
	return resp, nil
}

func (r *recorder) CreateContainer(ctx context.Context, req *kubeapi.CreateContainerRequest) (*kubeapi.CreateContainerResponse, error) {
	resp, err := r.RemoteRuntime.CreateContainer(ctx, req)
	if err != nil {
		return nil, err
	}
	cfg := req.GetConfig()
	rec := record{
		Time:         time.Now().UTC().Format(time.RFC3339Nano),
		ContainerID:  resp.GetContainerId(),
		PodSandboxID: req.GetPodSandboxId(),
		Namespace:    req.GetSandboxConfig().GetMetadata().GetNamespace(),
		Pod:          req.GetSandboxConfig().GetMetadata().GetName(),
		PodUID:       req.GetSandboxConfig().GetMetadata().GetUid(),
		Container:    cfg.GetMetadata().GetName(),
		Attempt:      cfg.GetMetadata().GetAttempt(),
		Image:        cfg.GetImage().GetImage(),
		Command:      cfg.GetCommand(),
		Args:         cfg.GetArgs(),
		Env:          map[string]string{},
		Mounts:       []mount{},
		Devices:      []device{},
		CDIDevices:   []string{},
		Annotations:  cfg.GetAnnotations(),
		CRIEnv:       []envVar{},
		CRIMounts:    []mount{},
		Hooks:        []hookResult{},
	}
	var env [][2]string
	for _, kv := range cfg.GetEnvs() {
		env = append(env, [2]string{kv.GetKey(), string(kv.GetValue())})
		rec.CRIEnv = append(rec.CRIEnv, envVar{kv.GetKey(), string(kv.GetValue())})
	}
	for _, m := range cfg.GetMounts() {
		rec.CRIMounts = append(rec.CRIMounts, mount{m.GetContainerPath(), m.GetHostPath(), m.GetReadonly()})
	}
	for _, d := range cfg.GetDevices() {
		rec.Devices = append(rec.Devices, device{d.GetContainerPath(), d.GetHostPath(), d.GetPermissions()})
	}
	for _, c := range cfg.GetCDIDevices() {
		rec.CDIDevices = append(rec.CDIDevices, c.GetName())
	}
	rec.CDIApplied = cdiNames(rec.CDIDevices, cfg.GetAnnotations())
	hostname := req.GetSandboxConfig().GetHostname()
	if hostname == "" { // containerd's fallback: the machine's
		hostname, _ = os.Hostname()
	}
	final := resolve(hostname, env, rec.CRIMounts, rec.CDIApplied, r.cdiDirs)
	rec.Env = firstValues(final.Env)
	for _, kv := range final.Env {
		rec.Environ = append(rec.Environ, kv.Name+"="+kv.Value)
	}
	rec.Mounts = append(rec.Mounts, final.Mounts...)
	rec.CDISpecs = final.Specs
	var failure error
	if len(final.Unresolved) > 0 {
		failure = fmt.Errorf("unresolvable CDI devices %s", strings.Join(final.Unresolved, ", "))
	}
	var proc *workload
	if failure == nil {
		proc, failure = startWorkload(r.cgroupRoot, rec.ContainerID)
	}
	if proc != nil {
		rec.Pid, rec.Cgroup = proc.cmd.Process.Pid, proc.cgroup
		bundle := filepath.Join(r.bundles, rec.ContainerID)
		_ = os.MkdirAll(bundle, 0o755)
		if failure = writeConfig(bundle, final.Env); failure == nil {
			rec.Hooks, failure = runHooks(final.Hooks, rec.ContainerID, bundle, rec.Pid)
		}
		if rec.Hooks == nil {
			rec.Hooks = []hookResult{}
		}
	}
	if failure != nil {
		rec.Error = failure.Error()
		if proc != nil {
			proc.stop()
		}
		_, _ = r.RemoteRuntime.RemoveContainer(ctx, &kubeapi.RemoveContainerRequest{ContainerId: rec.ContainerID})
	}
	line, err := json.Marshal(rec)
	if err != nil {
		return nil, err
	}
	initContainer := failure == nil && r.isInitContainer(ctx, rec.Namespace, rec.Pod, rec.Container)
	r.mu.Lock()
	defer r.mu.Unlock()
	if initContainer {
		r.exitOnStart[rec.ContainerID] = true
	}
	if proc != nil && failure == nil {
		r.workloads[rec.ContainerID] = proc
	}
	if _, err := r.out.Write(append(line, '\n')); err != nil {
		return nil, fmt.Errorf("recording container: %w", err)
	}
	if failure != nil {
		return nil, failure
	}
	return resp, nil
}

func (r *recorder) RemoveContainer(ctx context.Context, req *kubeapi.RemoveContainerRequest) (*kubeapi.RemoveContainerResponse, error) {
	r.mu.Lock()
	proc := r.workloads[req.GetContainerId()]
	delete(r.workloads, req.GetContainerId())
	r.mu.Unlock()
	if proc != nil {
		proc.stop()
	}
	return r.RemoteRuntime.RemoveContainer(ctx, req)
}

func (r *recorder) stopAll() {
	r.mu.Lock()
	defer r.mu.Unlock()
	for id, proc := range r.workloads {
		proc.stop()
		delete(r.workloads, id)
	}
}

func main() {
	socket := flag.String("socket", "", "unix socket to serve the CRI on")
	recordPath := flag.String("record", "", "file to append one JSON line per created container to")
	kubeconfig := flag.String("kubeconfig", "", "credentials to read pods with (init containers then finish)")
	cdiDirs := flag.String("cdi-dirs", "/etc/cdi,/var/run/cdi", "comma-separated CDI spec directories (later ones win)")
	cgroupRoot := flag.String("cgroup-root", "/sys/fs/cgroup", "where containers' processes get a cgroup v2 directory (k8s.io/<id>, as containerd); empty: none")
	bundles := flag.String("bundles", "", "directory of the containers' bundle directories (default: beside --record)")
	flag.Parse()
	if *socket == "" || *recordPath == "" {
		fmt.Fprintln(os.Stderr, "usage: crifake --socket PATH --record FILE")
		os.Exit(2)
	}
	out, err := os.OpenFile(*recordPath, os.O_CREATE|os.O_APPEND|os.O_WRONLY, 0o644)
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(1)
	}
	_ = os.Remove(*socket)
	lis, err := net.Listen("unix", *socket)
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(1)
	}
	rt := fake.NewFakeRemoteRuntime()
	// What fake.RemoteRuntime.Start sets: the runtime and its network report ready.
	rt.RuntimeService.FakeStatus = &kubeapi.RuntimeStatus{Conditions: []*kubeapi.RuntimeCondition{
		{Type: kubeapi.RuntimeReady, Status: true},
		{Type: kubeapi.NetworkReady, Status: true},
	}}
	// The fake's pulled images have size 0 unless told, and the kubelet refuses those.
	rt.ImageService.SetFakeImageSize(1 << 20)
	rec := &recorder{RemoteRuntime: rt, out: out, exitOnStart: map[string]bool{},
		cgroupRoot: *cgroupRoot, bundles: *bundles, workloads: map[string]*workload{}}
	for _, d := range strings.Split(*cdiDirs, ",") {
		if d = strings.TrimSpace(d); d != "" {
			rec.cdiDirs = append(rec.cdiDirs, d)
		}
	}
	if rec.bundles == "" {
		rec.bundles = filepath.Join(filepath.Dir(*recordPath), "bundles")
	}
	if *kubeconfig != "" {
		config, err := clientcmd.BuildConfigFromFlags("", *kubeconfig)
		if err != nil {
			fmt.Fprintln(os.Stderr, err)
			os.Exit(1)
		}
		rec.client = kubernetes.NewForConfigOrDie(config)
	}
	srv := grpc.NewServer()
	kubeapi.RegisterRuntimeServiceServer(srv, rec)
	kubeapi.RegisterImageServiceServer(srv, rt)
	sigs := make(chan os.Signal, 1)
	signal.Notify(sigs, syscall.SIGTERM, syscall.SIGINT)
	go func() {
		<-sigs
		srv.Stop()
	}()
	fmt.Fprintf(os.Stderr, "crifake: serving %s, recording to %s\n", *socket, *recordPath)
	err = srv.Serve(lis)
	// before exiting, not beside it: the containers' processes killed and their cgroup
	// directories removed (main returning ended the process before a goroutine's clean-up
	// and left k8s.io/<id> directories in the machine's cgroup v2 hierarchy)
	rec.stopAll()
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(1)
	}
}
