package admission

import (
	admissionregistrationv1 "k8s.io/api/admissionregistration/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
)

// Names of mgpu's MutatingWebhookConfiguration and of its one webhook
// (the chart's, charts/mgpu/templates/webhook-admission.yaml).
const (
	ConfigurationName = "mgpu-policy"
	WebhookName       = "mgpu-policy.vke.volcengine.com"
)

// TimeoutSeconds is how long the API server waits for the webhook.
const TimeoutSeconds = 5

// ExcludedNamespace is not sent to the webhook: the webhook itself runs
// there, and with failurePolicy Fail a webhook that checked its own pods
// could not start again once it was down.
const ExcludedNamespace = "kube-system"

// ServiceClient returns the client configuration of a webhook served by
// the Service name in namespace (port 443, path MutatePath), whose
// certificate caBundle (PEM) signed.
func ServiceClient(namespace, name string, caBundle []byte) admissionregistrationv1.WebhookClientConfig {
	return admissionregistrationv1.WebhookClientConfig{
		Service: &admissionregistrationv1.ServiceReference{
			Namespace: namespace, Name: name, Path: ptr(MutatePath), Port: ptr(int32(443)),
		},
		CABundle: caBundle,
	}
}

// URLClient returns the client configuration of a webhook the API server
// calls at url (e.g. "https://127.0.0.1:8443/mutate"), whose certificate
// caBundle (PEM) signed.
func URLClient(url string, caBundle []byte) admissionregistrationv1.WebhookClientConfig {
	return admissionregistrationv1.WebhookClientConfig{URL: ptr(url), CABundle: caBundle}
}

// WebhookConfiguration returns mgpu's MutatingWebhookConfiguration, named
// name, calling the webhook through client: pods being created, in every
// namespace but ExcludedNamespace, are sent to it; the API server refuses
// a pod when the webhook does not answer within TimeoutSeconds
// (failurePolicy Fail), as a pod admitted unchecked could land on a node
// of another policy.
func WebhookConfiguration(name string, client admissionregistrationv1.WebhookClientConfig) *admissionregistrationv1.MutatingWebhookConfiguration {
	return &admissionregistrationv1.MutatingWebhookConfiguration{
		TypeMeta:   metav1.TypeMeta{APIVersion: "admissionregistration.k8s.io/v1", Kind: "MutatingWebhookConfiguration"},
		ObjectMeta: metav1.ObjectMeta{Name: name},
		Webhooks: []admissionregistrationv1.MutatingWebhook{{
			Name:         WebhookName,
			ClientConfig: client,
			Rules: []admissionregistrationv1.RuleWithOperations{{
				Operations: []admissionregistrationv1.OperationType{admissionregistrationv1.Create},
				Rule: admissionregistrationv1.Rule{
					APIGroups:   []string{""},
					APIVersions: []string{"v1"},
					Resources:   []string{"pods"},
					Scope:       ptr(admissionregistrationv1.NamespacedScope),
				},
			}},
			FailurePolicy: ptr(admissionregistrationv1.Fail),
			MatchPolicy:   ptr(admissionregistrationv1.Equivalent),
			NamespaceSelector: &metav1.LabelSelector{MatchExpressions: []metav1.LabelSelectorRequirement{{
				Key: "kubernetes.io/metadata.name", Operator: metav1.LabelSelectorOpNotIn, Values: []string{ExcludedNamespace},
			}}},
			SideEffects:             ptr(admissionregistrationv1.SideEffectClassNone),
			TimeoutSeconds:          ptr(int32(TimeoutSeconds)),
			AdmissionReviewVersions: []string{"v1"},
			ReinvocationPolicy:      ptr(admissionregistrationv1.NeverReinvocationPolicy),
		}},
	}
}

func ptr[T any](v T) *T { return &v }
