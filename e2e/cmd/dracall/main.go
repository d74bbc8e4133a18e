// dracall calls a DRA kubelet plugin the way the kubelet does, with the kubelet's own gRPC
// client code (grpc-go and the k8s.io/kubelet DRA v1 API), and times each call as the
// kubelet would see it. `make bench` uses it to measure NodePrepareResources without the
// cost of a Python caller in the figure.
//
// It reads one request per line on stdin and answers one line on stdout:
//
//	prepare <namespace> <name> <uid>    ->  <seconds> <error, or nothing>
//	unprepare <namespace> <name> <uid>  ->  <seconds> <error, or nothing>
//	empty                               ->  <seconds>   (NodePrepareResources, no claim)
package main

import (
	"bufio"
	"context"
	"flag"
	"fmt"
	"os"
	"strings"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	drapb "k8s.io/kubelet/pkg/apis/dra/v1"
)

func main() {
	socket := flag.String("socket", "", "the plugin's service socket (dra.sock)")
	flag.Parse()
	if *socket == "" {
		fmt.Fprintln(os.Stderr, "dracall: --socket is required")
		os.Exit(2)
	}
	conn, err := grpc.NewClient("unix://"+*socket,
		grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		fmt.Fprintf(os.Stderr, "dracall: %v\n", err)
		os.Exit(1)
	}
	defer conn.Close()
	client := drapb.NewDRAPluginClient(conn)
	in := bufio.NewScanner(os.Stdin)
	out := bufio.NewWriter(os.Stdout)
	for in.Scan() {
		fields := strings.Fields(in.Text())
		if len(fields) == 0 {
			continue
		}
		var claims []*drapb.Claim
		if len(fields) == 4 {
			claims = []*drapb.Claim{{Namespace: fields[1], Name: fields[2], Uid: fields[3]}}
		}
		ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
		began := time.Now()
		problem := ""
		switch fields[0] {
		case "prepare", "empty":
			answer, err := client.NodePrepareResources(ctx, &drapb.NodePrepareResourcesRequest{Claims: claims})
			if err != nil {
				problem = err.Error()
			} else if len(claims) == 1 {
				if got, ok := answer.Claims[claims[0].Uid]; !ok {
					problem = "no answer for the claim"
				} else {
					problem = got.Error
				}
			}
		case "unprepare":
			answer, err := client.NodeUnprepareResources(ctx, &drapb.NodeUnprepareResourcesRequest{Claims: claims})
			if err != nil {
				problem = err.Error()
			} else if got, ok := answer.Claims[claims[0].Uid]; ok {
				problem = got.Error
			}
		default:
			problem = "unknown request " + fields[0]
		}
		seconds := time.Since(began).Seconds()
		cancel()
		fmt.Fprintf(out, "%.9f %s\n", seconds, strings.ReplaceAll(problem, "\n", " "))
		if err := out.Flush(); err != nil {
			os.Exit(1)
		}
	}
}
