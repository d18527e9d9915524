package deviceplugin

import (
	"context"
	"fmt"

	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/fields"
	"k8s.io/client-go/kubernetes"
	podresourcesapi "k8s.io/kubelet/pkg/apis/podresources/v1"
)

// DefaultPodResourcesSocket is the kubelet's PodResources API.
const DefaultPodResourcesSocket = "/var/lib/kubelet/pod-resources/kubelet.sock"

// APIPods reads the pods of one node from the API server.
type APIPods struct {
	client kubernetes.Interface
	node   string
}

// NewAPIPods returns the pod source of node through client.
func NewAPIPods(client kubernetes.Interface, node string) *APIPods {
	return &APIPods{client: client, node: node}
}

// Pod implements PodSource.
func (a *APIPods) Pod(ctx context.Context, namespace, name string) (*corev1.Pod, error) {
	return a.client.CoreV1().Pods(namespace).Get(ctx, name, metav1.GetOptions{})
}

// NodePods implements PodSource: the pods whose spec.nodeName is the node.
func (a *APIPods) NodePods(ctx context.Context) ([]corev1.Pod, error) {
	l, err := a.client.CoreV1().Pods(metav1.NamespaceAll).List(ctx, metav1.ListOptions{
		FieldSelector: fields.OneTermEqualSelector("spec.nodeName", a.node).String(),
	})
	if err != nil {
		return nil, err
	}
	return l.Items, nil
}

// PodResources reads the kubelet's allocations of the schemes' Core
// resources through its PodResources API.
type PodResources struct {
	socket string
	conn   *grpc.ClientConn
	client podresourcesapi.PodResourcesListerClient
}

// maxPodResourcesMsg bounds an answer of the PodResources API (the
// kubelet's own client uses 16 MiB).
const maxPodResourcesMsg = 16 << 20

// NewPodResources returns the allocation source of the kubelet's
// PodResources socket; it connects lazily, and again after a kubelet
// restart.
func NewPodResources(socket string) (*PodResources, error) {
	conn, err := grpc.NewClient("unix://"+socket,
		grpc.WithTransportCredentials(insecure.NewCredentials()),
		grpc.WithDefaultCallOptions(grpc.MaxCallRecvMsgSize(maxPodResourcesMsg)))
	if err != nil {
		return nil, fmt.Errorf("the kubelet's PodResources API %s: %w", socket, err)
	}
	return &PodResources{socket: socket, conn: conn, client: podresourcesapi.NewPodResourcesListerClient(conn)}, nil
}

// Close closes the connection.
func (p *PodResources) Close() error { return p.conn.Close() }

// Allocations implements AllocationSource.
func (p *PodResources) Allocations(ctx context.Context) ([]Allocation, error) {
	resp, err := p.client.List(ctx, &podresourcesapi.ListPodResourcesRequest{})
	if err != nil {
		return nil, fmt.Errorf("the kubelet's PodResources API %s: %w", p.socket, err)
	}
	var out []Allocation
	for _, pod := range resp.GetPodResources() {
		for _, c := range pod.GetContainers() {
			by := map[corev1.ResourceName][]string{}
			for _, d := range c.GetDevices() {
				if r := corev1.ResourceName(d.GetResourceName()); isPluginResource(r) {
					by[r] = append(by[r], d.GetDeviceIds()...)
				}
			}
			for _, s := range PluginSchemes() {
				if ids := by[s.Core]; len(ids) > 0 {
					out = append(out, Allocation{Namespace: pod.GetNamespace(), Pod: pod.GetName(), Container: c.GetName(), Resource: s.Core, IDs: ids})
				}
			}
		}
	}
	return out, nil
}

// isPluginResource reports whether r is the resource of one of the node
// agent's plugins.
func isPluginResource(r corev1.ResourceName) bool {
	for _, s := range PluginSchemes() {
		if s.Core == r {
			return true
		}
	}
	return false
}
